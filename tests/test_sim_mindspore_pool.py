"""MindSpore's dynamic memory pool model: each rule on a small hand-checked trace."""

import pytest

from kvguard.sim.base import SimOutOfMemory
from kvguard.sim.device import Device
from kvguard.sim.mindspore_pool import DynamicMemPool

MIB = 1 << 20
GIB = 1 << 30


def pool(capacity=8 * GIB, **kwargs):
    return DynamicMemPool(Device(capacity), **kwargs)


def test_sizes_align_to_512_and_zero_takes_512():
    p = pool()
    assert p.buffer(p.malloc(0)).size == 512
    assert p.buffer(p.malloc(513)).size == 1024
    assert p.memory_stats()["total_allocated_memory"] == 1536


def test_first_common_block_is_the_increase_size():
    p = pool()
    p.malloc(1000)
    assert p.block_sizes(persistent=False) == [2 * GIB]
    assert p.memory_stats()["total_reserved_memory"] == 2 * GIB


def test_persistent_blocks_grow_in_1_gib_units():
    p = pool()
    p.malloc(1000)                          # the common pool has a block, without room for 2.5 GiB
    p.malloc(1000, persistent=True)
    p.malloc(int(2.5 * GIB), persistent=True)
    assert p.block_sizes(persistent=True) == [1 * GIB, 3 * GIB]


def test_persistent_miss_with_an_empty_common_pool_expands_the_common_pool():
    # AllocMemBuf falls back to the common allocator's Malloc, which expands an empty allocator.
    p = pool()
    p.malloc(1000, persistent=True)
    p.malloc(int(2.5 * GIB), persistent=True)
    assert p.block_sizes(persistent=True) == [1 * GIB]
    assert p.block_sizes(persistent=False) == [4 * GIB]


def test_pynative_growth_doubles_the_unit():
    p = pool(growth="double")
    p.malloc(int(2.5 * GIB), persistent=True)
    assert p.block_sizes(persistent=True) == [4 * GIB]


def test_a_block_is_capped_by_free_device_memory():
    p = pool(capacity=3 * GIB)
    p.malloc(2 * GIB)                      # first block: exactly 2 GiB
    p.malloc(100 * MIB)                    # 1 GiB left: the block shrinks to it
    assert p.block_sizes(persistent=False) == [2 * GIB, 1 * GIB]
    assert p.device.free_bytes == 0


def test_a_request_larger_than_free_device_memory_is_out_of_memory():
    p = pool(capacity=3 * GIB)
    p.malloc(2 * GIB)
    with pytest.raises(SimOutOfMemory) as caught:
        p.malloc(int(1.5 * GIB))
    assert caught.value.requested_bytes == int(1.5 * GIB)
    assert p.num_ooms == 1


def test_best_fit_takes_the_smallest_idle_buffer_that_fits():
    p = pool()
    a = p.malloc(300 * MIB)
    p.malloc(10 * MIB)                     # keeps a and c apart
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
    got = p.malloc(1 * MIB - 512)          # remainder exactly 512: split
    assert p.buffer(got).size == 1 * MIB - 512
    p.free(got)
    p.malloc(10 * MIB)                      # takes the tail; the freed 1 MiB stays idle
    assert p.buffer(p.malloc(1 * MIB - 256)).size == 1 * MIB  # remainder 256 < 512: whole buffer


def test_freed_buffers_merge_with_idle_neighbours():
    p = pool()
    a, b, c = p.malloc(100 * MIB), p.malloc(100 * MIB), p.malloc(100 * MIB)
    p.free(a)
    p.free(c)
    assert sorted(p.idle_buffer_sizes(persistent=False)) == [100 * MIB, 2 * GIB - 200 * MIB]
    p.free(b)
    assert p.idle_buffer_sizes(persistent=False) == [2 * GIB]


def test_persistent_request_falls_back_to_common_idle_memory_without_vmm():
    p = pool(capacity=int(2.5 * GIB))
    p.malloc(1000)                          # common block of 2 GiB, mostly idle
    p.malloc(300 * MIB, persistent=True)    # 0.5 GiB free: the persistent block fits
    p.malloc(400 * MIB, persistent=True)    # no room to expand: served from the common pool
    assert p.block_sizes(persistent=True) == [int(0.5 * GIB) - 0]
    assert p.memory_stats()["total_allocated_memory"] == 1024 + 700 * MIB


def test_common_request_never_uses_persistent_idle_memory():
    p = pool(capacity=int(1.5 * GIB))
    p.free(p.malloc(100 * MIB, persistent=True))   # 1 GiB persistent block, all idle
    with pytest.raises(SimOutOfMemory):
        p.malloc(600 * MIB)                         # 0.5 GiB free on the device


def test_empty_cache_without_vmm_releases_nothing():
    p = pool()
    p.free(p.malloc(100 * MIB))
    p.empty_cache()
    assert p.memory_stats()["total_reserved_memory"] == 2 * GIB


def test_vmm_reserves_address_space_and_maps_2_mib_pages():
    p = pool(enable_vmm=True)
    p.malloc(3 * MIB)
    stats = p.memory_stats()
    total = 8 * GIB
    assert stats["total_reserved_memory"] == total          # max(block, total_mem_size) of address space
    assert p.device.allocator_bytes == 4 * MIB               # two 2 MiB pages
    assert stats["total_eager_free_memory"] == total - 3 * MIB


def test_vmm_eager_free_unmaps_idle_pages_before_failing():
    p = pool(capacity=20 * MIB, enable_vmm=True)
    keep = p.malloc(6 * MIB)
    p.free(p.malloc(10 * MIB))            # idle but still mapped: 16 MiB mapped
    p.malloc(12 * MIB)                    # 4 MiB free physically: eager free, then map
    assert p.device.allocator_bytes == 18 * MIB
    p.free(keep)


def test_vmm_empty_cache_releases_the_whole_idle_pool():
    p = pool(enable_vmm=True)
    p.free(p.malloc(100 * MIB))
    p.empty_cache()
    assert p.memory_stats()["total_reserved_memory"] == 0
    assert p.device.allocator_bytes == 0


def test_max_allocated_memory_reads_the_increase_since_reset():
    p = pool()
    p.malloc(100 * MIB)
    p.reset_peak_memory_stats()
    assert p.memory_stats()["max_allocated_memory"] == 0
    p.free(p.malloc(50 * MIB))
    stats = p.memory_stats()
    assert stats["max_allocated_memory"] == 50 * MIB
    assert p.peak_allocated_bytes == 150 * MIB


def test_memory_stats_use_mindspore_key_names():
    p = pool()
    p.malloc(1, persistent=True)
    p.malloc(1)
    stats = p.memory_stats()
    assert set(stats) == {"total_reserved_memory", "total_allocated_memory", "total_idle_memory",
                          "total_eager_free_memory", "max_reserved_memory", "max_allocated_memory",
                          "common_mem_pool_stats", "persistent_mem_pool_stats"}
    assert stats["total_idle_memory"] == 3 * GIB - 1024
    common = stats["common_mem_pool_stats"]
    assert (common["block_unit_size"], common["block_counts"]) == (2 * GIB, 1)
    assert [info["block_memory_size"] for info in common["blocks_info"].values()] == [2 * GIB]
    assert stats["persistent_mem_pool_stats"]["block_unit_size"] == 1 * GIB
