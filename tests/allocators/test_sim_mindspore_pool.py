"""MindSpore's dynamic memory pool model, per release: each rule on a small hand-worked case, on the Python
model and on the C engine (tests/support/alloc_engines.py).

The rules and their sources are in kvguard/allocators/mindspore_releases.py; each test names the rule.
"""

import pytest
from alloc_engines import engine  # noqa: F401  (the fixture every test here uses)

from kvguard.allocators import native
from kvguard.allocators.base import AllocatorOutOfMemory
from kvguard.allocators.device import Device
from kvguard.allocators.mindspore_releases import (
    RELEASES,
    VLLM_MINDSPORE_LAUNCHERS,
    parse_alloc_conf,
    pool_budget_bytes,
    release,
    vmm_enabled,
)

MIB = 1 << 20
GIB = 1 << 30

pytestmark = pytest.mark.usefixtures("engine")


def free_for_budget(budget):
    """Device free memory whose pool budget, floor(free * 15/16 to 2 MiB) - 10 MiB, is ``budget`` (2 MiB multiple)."""
    return -(-(budget + 10 * MIB) * 16 // 15)


def pool(budget=8 * GIB, version="2.6.0", **kwargs):
    """A pool of ``budget`` bytes after vllm-mindspore's first jit_level O0 compile (task sink off)
    unless told otherwise."""
    kwargs.setdefault("task_sink", False)
    return native.mindspore_pool(Device(free_for_budget(budget)), version=version, **kwargs)


# ----------------------------------------------------------------- the budget and task sink
def test_the_pool_budget_is_15_16_of_free_memory_down_to_2_mib_less_10_mib():
    # 64 GiB free: MindSpore 2.7.1's compiled memory adapter reports total_mem_size 64,414,023,680.
    assert pool_budget_bytes(64 * GIB) == 64_414_023_680
    assert pool_budget_bytes(31 * GIB) == 29_750 * MIB  # 29,760 MiB less 10
    assert pool_budget_bytes(31 * GIB + MIB) == 29_750 * MIB  # 29,760.94 MiB: down to 2 MiB first
    assert native.mindspore_pool(Device(64 * GIB)).total_mem_size == 64_414_023_680


def test_without_vmm_blocks_stop_at_the_pool_budget_not_at_the_device():
    p = pool(budget=2 * GIB)
    with pytest.raises(AllocatorOutOfMemory):
        p.malloc(2 * GIB + 512)  # the device has 2.14 GiB free, the pool 2 GiB
    assert p.device.allocator_bytes == 0


def test_task_sink_defaults_on_and_a_jit_o0_compile_turns_it_off():
    p = native.mindspore_pool(Device(free_for_budget(16 * GIB)), version="2.7.1")
    p.malloc(int(2.5 * GIB), persistent=True)  # 1 + 1 + 1 GiB: adding units
    p.jit_o0_compile()
    p.malloc(int(2.5 * GIB))  # 1 -> 2 -> 4 GiB: doubling
    assert (p.block_sizes(persistent=True), p.block_sizes(persistent=False)) == ([3 * GIB], [4 * GIB])


# ----------------------------------------------------------------- sizes and units
def test_sizes_align_to_512_and_zero_takes_512():
    p = pool()
    assert p.buffer(p.malloc(0)).size == 512
    assert p.buffer(p.malloc(513)).size == 1024
    assert p.memory_stats()["total_allocated_memory"] == 1536


def test_default_unit_is_1_gib_for_both_pools():
    p = pool()
    p.malloc(1000)
    p.malloc(1000, persistent=True)
    assert p.block_sizes(persistent=False) == [1 * GIB]
    assert p.block_sizes(persistent=True) == [1 * GIB]


def test_graph_mode_with_task_sink_uses_8_mib_units_grown_by_adding():
    p = pool(graph_mode=True, task_sink=True)
    p.malloc(1000)
    p.malloc(20 * MIB)  # 8 -> 16 -> 24 MiB
    assert p.block_sizes(persistent=False) == [8 * MIB, 24 * MIB]


def test_graph_mode_without_task_sink_keeps_1_gib_units():
    p = pool(graph_mode=True, task_sink=False)
    p.malloc(1000)
    assert p.block_sizes(persistent=False) == [1 * GIB]


def test_without_task_sink_blocks_grow_by_doubling():
    p = pool()
    p.malloc(int(2.5 * GIB), persistent=True)  # 1 -> 2 -> 4 GiB
    assert p.block_sizes(persistent=True) == [4 * GIB]


def test_with_task_sink_blocks_grow_by_adding_units():
    p = pool(task_sink=True)  # PyNative: the unit stays 1 GiB
    p.malloc(int(2.5 * GIB), persistent=True)  # 1 -> 2 -> 3 GiB
    assert p.block_sizes(persistent=True) == [3 * GIB]


def test_a_configured_unit_applies_to_the_common_pool_only():
    p = pool(mempool_block_size=4 * GIB)
    p.malloc(1000)
    p.malloc(1000, persistent=True)
    assert p.block_sizes(persistent=False) == [4 * GIB]
    assert p.block_sizes(persistent=True) == [1 * GIB]


def test_a_configured_unit_is_capped_at_free_minus_1_gib():
    p = pool(budget=3 * GIB, mempool_block_size=4 * GIB)
    p.malloc(1000)  # min(4 GiB, 3 GiB - 1 GiB)
    assert p.block_sizes(persistent=False) == [2 * GIB]
    # memory_stats reports the unit set at the last expansion (SetMemPoolBlockSize), not today's.
    assert p.memory_stats()["commom_mem_pool_stats"]["block_unit_size"] == 2 * GIB
    p.malloc(2 * GIB - 1024)  # fills the block
    p.malloc(100 * MIB)  # 1 GiB free, not above the reserve: unit min(4, 1) GiB
    assert p.block_sizes(persistent=False) == [2 * GIB, 1 * GIB]
    assert p.memory_stats()["commom_mem_pool_stats"]["block_unit_size"] == 1 * GIB


def test_a_configured_1_gb_unit_is_the_default_rule():
    # kDefaultMempoolBlockSize is 1.0 GB: configuring it is the same as not configuring.
    p = pool(graph_mode=True, task_sink=True, mempool_block_size=1 * GIB)
    p.malloc(1000)
    assert p.block_sizes(persistent=False) == [8 * MIB]


def test_a_block_is_capped_by_what_is_left_of_the_pool_budget():
    p = pool(budget=3 * GIB)
    p.malloc(2 * GIB)  # first block: exactly 2 GiB
    p.malloc(100 * MIB)  # 1 GiB left: the 1 GiB unit fits it exactly
    p.malloc(100 * MIB)  # fits the second block's tail
    assert p.block_sizes(persistent=False) == [2 * GIB, 1 * GIB]
    assert p.free_mem_size == 0


def test_a_request_larger_than_free_device_memory_is_out_of_memory():
    p = pool(budget=3 * GIB)
    p.malloc(2 * GIB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        p.malloc(int(1.5 * GIB))
    assert caught.value.requested_bytes == int(1.5 * GIB)
    assert p.num_ooms == 1


# ----------------------------------------------------------------- buffers
def test_best_fit_takes_the_smallest_idle_buffer_that_fits():
    p = pool()
    a = p.malloc(300 * MIB)
    p.malloc(10 * MIB)  # keeps a and c apart
    c = p.malloc(200 * MIB)
    p.malloc(10 * MIB)
    p.free(a)
    p.free(c)
    assert p.malloc(150 * MIB) == c


def test_remainder_under_512_is_not_split_off():
    p = pool()
    a = p.malloc(1 * MIB)
    p.malloc(4096)
    p.free(a)
    got = p.malloc(1 * MIB - 512)  # remainder exactly 512: split
    assert p.buffer(got).size == 1 * MIB - 512
    p.free(got)
    p.malloc(10 * MIB)  # takes the tail; the freed 1 MiB stays idle
    assert p.buffer(p.malloc(1 * MIB - 256)).size == 1 * MIB  # remainder 256 < 512: whole buffer


def test_freed_buffers_merge_with_idle_neighbours():
    p = pool()
    a, b, c = p.malloc(100 * MIB), p.malloc(100 * MIB), p.malloc(100 * MIB)
    p.free(a)
    p.free(c)
    assert sorted(p.idle_buffer_sizes(persistent=False)) == [100 * MIB, 1 * GIB - 200 * MIB]
    p.free(b)
    assert p.idle_buffer_sizes(persistent=False) == [1 * GIB]


# ----------------------------------------------------------------- fallbacks between the pools
def test_persistent_request_falls_back_to_common_idle_memory_without_vmm():
    p = pool(budget=int(1.5 * GIB))
    p.malloc(1000)  # common block of 1 GiB, mostly idle
    p.malloc(300 * MIB, persistent=True)  # 0.5 GiB free: the persistent block is 0.5 GiB
    p.malloc(400 * MIB, persistent=True)  # 200 MiB idle there: served from the common pool
    assert p.block_sizes(persistent=True) == [GIB // 2]
    assert p.block_sizes(persistent=False) == [1 * GIB]
    assert p.memory_stats()["total_allocated_memory"] == 1024 + 700 * MIB


def test_persistent_miss_with_an_empty_common_pool_expands_the_common_pool():
    # AllocMemBuf switches to the common allocator, whose Malloc expands an empty allocator.
    p = pool()
    p.malloc(1000, persistent=True)
    p.malloc(int(2.5 * GIB), persistent=True)  # common unit 1 GiB, doubled to 4 GiB
    assert p.block_sizes(persistent=True) == [1 * GIB]
    assert p.block_sizes(persistent=False) == [4 * GIB]


def test_in_2_4_a_common_request_never_uses_persistent_idle_memory():
    p = pool(budget=int(1.5 * GIB), version="2.4.0")
    p.free(p.malloc(100 * MIB, persistent=True))  # 1 GiB persistent block, all idle
    with pytest.raises(AllocatorOutOfMemory):
        p.malloc(600 * MIB)  # 0.5 GiB free on the device: no block


@pytest.mark.parametrize("version", ["2.5.0", "2.6.0", "2.7.1", "2.10.0"])
def test_from_2_5_a_failed_common_expansion_falls_back_to_persistent_idle_memory(version):
    p = pool(budget=int(1.5 * GIB), version=version)
    p.free(p.malloc(100 * MIB, persistent=True))
    addr = p.malloc(600 * MIB)
    assert p.block_sizes(persistent=False) == []
    assert p.buffer(addr).size == 600 * MIB and p.allocated_bytes == 600 * MIB


# ----------------------------------------------------------------- empty_cache
@pytest.mark.parametrize("version", ["2.4.0", "2.5.0"])
def test_before_2_6_empty_cache_does_nothing(version):
    p = pool(version=version)
    p.free(p.malloc(100 * MIB))
    p.empty_cache()
    assert p.memory_stats()["total_reserved_memory"] == 1 * GIB


def test_from_2_6_empty_cache_without_vmm_releases_wholly_idle_blocks():
    p = pool()
    p.free(p.malloc(100 * MIB))  # block 1: all idle
    p.malloc(2 * GIB)  # block 2 (2 GiB): in use
    p.empty_cache()
    assert p.block_sizes(persistent=False) == [2 * GIB]
    assert p.memory_stats()["total_reserved_memory"] == 2 * GIB
    assert p.device.allocator_bytes == 2 * GIB


# ----------------------------------------------------------------- VMM
def test_vmm_maps_2_mib_pages_and_from_2_6_reserved_counts_them():
    p = pool(enable_vmm=True)
    p.malloc(3 * MIB)
    stats = p.memory_stats()
    assert p.device.allocator_bytes == 4 * MIB  # two 2 MiB pages
    assert stats["total_reserved_memory"] == 4 * MIB  # GetVmmUsedMemSize
    assert stats["total_eager_free_memory"] == 8 * GIB - 3 * MIB  # address space max(block, total) less mapped


@pytest.mark.parametrize("version", ["2.4.0", "2.5.0"])
def test_vmm_before_2_6_reserved_counts_the_address_space(version):
    p = pool(enable_vmm=True, version=version)
    p.malloc(3 * MIB)
    assert p.memory_stats()["total_reserved_memory"] == 8 * GIB
    assert p.device.allocator_bytes == 4 * MIB


def test_vmm_eager_free_unmaps_idle_pages_into_the_cache_and_remaps_them():
    p = pool(budget=20 * MIB, enable_vmm=True)
    p.malloc(6 * MIB)  # pages 0-2
    p.free(p.malloc(10 * MIB))  # [6, 16) MiB idle, pages 3-7 still mapped: 16 MiB
    p.malloc(12 * MIB)  # no fit: eager free puts pages 3-7 in the cache, then
    #                                       [6, 18) MiB maps pages 3-8: 5 from the cache, 1 new
    assert p.device.allocator_bytes == 18 * MIB
    assert p.memory_stats()["total_reserved_memory"] == 18 * MIB


@pytest.mark.parametrize("version, same_address, device_bytes", [("2.6.0", True, 6 * MIB), ("2.5.0", False, 10 * MIB)])
def test_vmm_an_idle_buffer_grows_into_its_eager_free_neighbour_from_2_6(version, same_address, device_bytes):
    p = pool(enable_vmm=True, version=version)
    first = p.malloc(4 * MIB)  # pages 0-1 mapped; the rest of the block eager-free
    p.free(first)  # [0, 4) MiB idle, next to the eager-free rest
    second = p.malloc(6 * MIB)
    # 2.6+: the idle 4 MiB takes 2 MiB from its neighbour and maps page 2 only. 2.5: the eager-free
    # rest is the best fit, [4, 10) MiB, and maps pages 2-4.
    assert (second == first, p.device.allocator_bytes) == (same_address, device_bytes)


def test_vmm_unmapped_pages_stay_allocated_until_empty_cache():
    p = pool(enable_vmm=True)
    p.malloc(4 * MIB)
    p.free(p.malloc(10 * MIB))
    p._eager_free_idle()  # what a miss does first
    assert p.device.allocator_bytes == 14 * MIB  # cached handles are still physical memory
    p.empty_cache()
    assert p.device.allocator_bytes == 4 * MIB
    assert p.memory_stats()["total_reserved_memory"] == 4 * MIB


def test_vmm_refuses_a_page_the_device_cannot_hold():
    device = Device(free_for_budget(8 * MIB))
    p = native.mindspore_pool(device, version="2.6.0", enable_vmm=True)
    p.malloc(4 * MIB)
    assert device.grow_non_allocator(device.free_bytes - 2 * MIB)  # runtime memory taken after the pool started
    with pytest.raises(AllocatorOutOfMemory):
        p.malloc(4 * MIB)  # needs two new pages, one fits
    assert device.free_bytes == 0  # the page got before the refusal is kept, cached


# ----------------------------------------------------------------- statistics
@pytest.mark.parametrize("version", ["2.4.0", "2.5.0"])
def test_before_2_6_max_allocated_memory_is_the_increase_since_reset(version):
    p = pool(version=version)
    p.malloc(100 * MIB)
    p.reset_peak_memory_stats()
    assert p.memory_stats()["max_allocated_memory"] == 0
    p.free(p.malloc(50 * MIB))
    assert p.memory_stats()["max_allocated_memory"] == 50 * MIB
    assert p.peak_allocated_bytes == 150 * MIB


def test_before_2_6_max_reserved_memory_is_reserved_now_minus_at_reset():
    p = pool(version="2.5.0")
    p.malloc(100 * MIB)
    p.reset_peak_memory_stats()
    p.malloc(2 * GIB)  # a 2 GiB block
    assert p.memory_stats()["max_reserved_memory"] == 2 * GIB


def test_from_2_6_max_stats_are_absolute_peaks_since_reset():
    p = pool()
    p.malloc(100 * MIB)
    p.reset_peak_memory_stats()
    p.free(p.malloc(50 * MIB))
    stats = p.memory_stats()
    assert stats["max_allocated_memory"] == 150 * MIB
    assert stats["max_reserved_memory"] == 1 * GIB


@pytest.mark.parametrize(
    "version, allocated_key, common_key",
    [
        ("2.4.0", "total_allocatd_memory", "commom_mem_pool_stats"),
        ("2.4.10", "total_allocatd_memory", "commom_mem_pool_stats"),
        ("2.5.0", "total_allocated_memory", "commom_mem_pool_stats"),
        ("2.7.1", "total_allocated_memory", "commom_mem_pool_stats"),
        ("2.8.0", "total_allocated_memory", "common_mem_pool_stats"),
        ("2.10.0", "total_allocated_memory", "common_mem_pool_stats"),
    ],
)
def test_memory_stats_use_the_release_key_spellings(version, allocated_key, common_key):
    p = pool(version=version)
    p.malloc(1, persistent=True)
    p.malloc(1)
    stats = p.memory_stats()
    assert set(stats) == {
        "total_reserved_memory",
        allocated_key,
        "total_idle_memory",
        "total_eager_free_memory",
        "max_reserved_memory",
        "max_allocated_memory",
        common_key,
        "persistent_mem_pool_stats",
    }
    assert stats[allocated_key] == 1024
    assert stats["total_idle_memory"] == 2 * GIB - 1024
    common = stats[common_key]
    assert (common["block_unit_size"], common["block_counts"]) == (1 * GIB, 1)
    assert [info["block_memory_size"] for info in common["blocks_info"].values()] == [1 * GIB]


# ----------------------------------------------------------------- the table and MS_ALLOC_CONF
def test_every_release_cites_every_rule():
    rules = {
        "align",
        "unit",
        "small_unit",
        "cap",
        "growth",
        "persistent_to_common",
        "common_to_persistent",
        "eager_free",
        "stats_keys",
        "stats_rule",
        "empty_cache",
        "vmm_default",
        "vmm_page",
        "alloc_conf",
    }
    for row in RELEASES:
        assert rules <= set(row.cites), row.version
        assert row.source_note or row.source_ref == f"v{row.version}", row.version


def test_releases_are_found_by_short_and_post_versions():
    assert release("2.5").version == "2.5.0"
    assert release("2.7.1.post1").version == "2.7.1"
    with pytest.raises(ValueError, match="unknown MindSpore version"):
        release("2.3.0")


def test_alloc_conf_is_parsed_like_mindspore():
    conf = parse_alloc_conf('"enable_vmm : True; vmm_align_size:4MB ,memory_tracker"', release("2.6.0"))
    assert dict(conf.items) == {"enable_vmm": "True", "vmm_align_size": "4MB"}  # no ':': ignored
    assert conf.flag("enable_vmm") is True and conf.vmm_page_bytes == 4 * MIB


def test_an_unknown_alloc_conf_key_is_a_one_line_error():
    with pytest.raises(ValueError, match="'derag_memory_step_freq' is not one MindSpore 2.7.1 reads"):
        parse_alloc_conf(VLLM_MINDSPORE_LAUNCHERS["0.5.1"].ms_alloc_conf, release("2.7.1"))


def test_the_launcher_string_read_as_mindspore_reads_it_turns_vmm_on():
    conf = parse_alloc_conf(VLLM_MINDSPORE_LAUNCHERS["0.5.1"].ms_alloc_conf, release("2.7.1"), strict=False)
    assert dict(conf.items) == {"enable_vmm": "true"}


def test_vmm_defaults_on_for_910b_and_the_explicit_key_wins():
    empty = parse_alloc_conf(None, release("2.6.0"))
    off = parse_alloc_conf("enable_vmm:False", release("2.6.0"))
    on = parse_alloc_conf("enable_vmm:true", release("2.6.0"))
    assert vmm_enabled(empty) is True
    assert vmm_enabled(empty, soc_supports_vmm=False) is False
    assert vmm_enabled(off) is False
    assert vmm_enabled(on, soc_supports_vmm=False) is True
    assert vmm_enabled(on, jit_o2_without_ge_kernel=True) is False
    assert vmm_enabled(parse_alloc_conf("enable_vmm:yes", release("2.6.0"))) is True  # neither: the default


def test_an_odd_vmm_align_size_is_refused():
    with pytest.raises(ValueError, match="multiple of 2"):
        parse_alloc_conf("vmm_align_size:3MB", release("2.6.0")).vmm_page_bytes


def test_simple_tracker_is_a_key_from_2_7_only():
    parse_alloc_conf("simple_tracker:True", release("2.7.0"))
    with pytest.raises(ValueError):
        parse_alloc_conf("simple_tracker:True", release("2.6.0"))
