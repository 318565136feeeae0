"""PyTorch's caching allocator model: each rule on a small hand-checked trace, on the Python model and on
the C engine (tests/support/alloc_engines.py)."""

import pytest
from alloc_engines import engine  # noqa: F401  (the fixture every test here uses)

from kvguard.allocators import native
from kvguard.allocators.base import AllocatorOutOfMemory
from kvguard.allocators.device import Device

MIB = 1 << 20

pytestmark = pytest.mark.usefixtures("engine")


def alloc(capacity=1 << 30, **kwargs):
    return native.caching_allocator(Device(capacity), **kwargs)


def block_size(a, addr):
    return a.block_at(addr).size


def test_requests_round_up_to_512_bytes():
    a = alloc()
    assert block_size(a, a.malloc(1)) == 512
    assert block_size(a, a.malloc(512)) == 512
    assert block_size(a, a.malloc(513)) == 1024
    assert a.memory_stats()["requested_bytes.all.current"] == 1 + 512 + 513


def test_torch_npu_adds_32_bytes_before_rounding():
    a = alloc(variant="torch_npu")
    assert block_size(a, a.malloc(480)) == 512
    assert block_size(a, a.malloc(481)) == 1024
    assert block_size(a, a.malloc(1 * MIB - 32)) == 1 * MIB


def test_one_mib_is_the_last_small_pool_size():
    a = alloc()
    a.malloc(1 * MIB)
    a.malloc(1 * MIB + 1)
    stats = a.memory_stats()
    assert stats["reserved_bytes.small_pool.current"] == 2 * MIB
    assert stats["reserved_bytes.large_pool.current"] == 20 * MIB


@pytest.mark.parametrize(
    "request_bytes, segment_bytes",
    [
        (100, 2 * MIB),  # small pool: 2 MiB segments
        (1 * MIB + 1, 20 * MIB),  # large, under 10 MiB: 20 MiB segments
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB - 1, 10 * MIB),  # rounding to 512 comes first
        (10 * MIB, 10 * MIB),  # from 10 MiB: rounded up to 2 MiB
        (11 * MIB + 1, 12 * MIB),
    ],
)
def test_segment_sizes(request_bytes, segment_bytes):
    a = alloc()
    a.malloc(request_bytes)
    assert [size for _, size, _ in a.segments()] == [segment_bytes]


def test_best_fit_prefers_the_smaller_block_over_the_lower_address():
    a = alloc()
    big = a.malloc(14 * MIB)  # first segment, lower address
    small = a.malloc(12 * MIB)
    a.free(big)
    a.free(small)
    got = a.malloc(11 * MIB)
    assert got == small
    assert a.segments()[1][0] == small


def test_best_fit_breaks_size_ties_by_address():
    a = alloc()
    first = a.malloc(12 * MIB)
    second = a.malloc(12 * MIB)
    a.free(second)
    a.free(first)
    assert a.malloc(12 * MIB) == first


def test_large_block_is_split_when_more_than_1_mib_remains():
    a = alloc()
    a.free(a.malloc(14 * MIB))
    a.malloc(12 * MIB)
    assert a.free_block_sizes(small=False) == [2 * MIB]
    assert a.memory_stats()["inactive_split_bytes.large_pool.current"] == 2 * MIB


def test_large_block_is_not_split_when_exactly_1_mib_remains():
    a = alloc()
    a.free(a.malloc(14 * MIB))
    addr = a.malloc(13 * MIB)
    assert block_size(a, addr) == 14 * MIB
    assert a.free_block_sizes(small=False) == []
    assert a.memory_stats()["allocated_bytes.all.current"] == 14 * MIB


def test_small_block_is_split_down_to_512_bytes():
    a = alloc()
    a.malloc(1 * MIB)
    a.malloc(1 * MIB - 512)
    assert a.free_block_sizes(small=True) == [512]


def test_oversize_block_is_never_given_to_a_request_under_max_split_size():
    a = alloc(max_split_size=40 * MIB)
    a.free(a.malloc(60 * MIB))
    a.malloc(30 * MIB)
    assert sorted(size for _, size, _ in a.segments()) == [30 * MIB, 60 * MIB]
    assert a.memory_stats()["max_split_size"] == 40 * MIB


def test_oversize_request_takes_a_block_less_than_20_mib_larger_and_does_not_split_it():
    a = alloc(max_split_size=40 * MIB)
    cached = a.malloc(60 * MIB)
    a.free(cached)
    assert a.malloc(50 * MIB) == cached
    assert block_size(a, cached) == 60 * MIB


def test_oversize_request_skips_a_block_20_mib_or_more_larger():
    a = alloc(max_split_size=40 * MIB)
    a.free(a.malloc(80 * MIB))
    a.malloc(60 * MIB)
    assert sorted(size for _, size, _ in a.segments()) == [60 * MIB, 80 * MIB]


def test_freed_neighbours_merge_back_into_the_whole_segment():
    a = alloc()
    x, y, z = a.malloc(4 * MIB), a.malloc(4 * MIB), a.malloc(4 * MIB)
    a.free(x)
    a.free(y)
    assert a.free_block_sizes(small=False) == [8 * MIB, 8 * MIB]
    assert a.memory_stats()["inactive_split.large_pool.current"] == 2
    a.free(z)
    assert a.free_block_sizes(small=False) == [20 * MIB]
    stats = a.memory_stats()
    assert stats["inactive_split.large_pool.current"] == 0
    assert stats["inactive_split_bytes.large_pool.current"] == 0


def test_failed_segment_allocation_frees_cached_segments_and_retries():
    a = alloc(capacity=40 * MIB)
    a.free(a.malloc(3 * MIB))  # a cached 20 MiB segment
    a.malloc(30 * MIB)  # 20 MiB free on the device: needs the cache flushed
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == 1
    assert stats["num_ooms"] == 0
    assert stats["reserved_bytes.all.current"] == 30 * MIB
    assert stats["num_device_free"] == 1


def test_out_of_memory_after_the_retry_counts_num_ooms():
    a = alloc(capacity=40 * MIB)
    a.malloc(30 * MIB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        a.malloc(12 * MIB)
    assert caught.value.requested_bytes == 12 * MIB
    stats = a.memory_stats()
    assert (stats["num_alloc_retries"], stats["num_ooms"]) == (1, 1)


def test_split_segments_survive_the_flush():
    a = alloc(capacity=44 * MIB)
    keep = a.malloc(4 * MIB)  # 20 MiB segment, split: 4 MiB used + 16 MiB cached
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(30 * MIB)  # the split segment cannot be released
    assert a.reserved_bytes == 20 * MIB
    assert a.memory_stats()["inactive_split_bytes.all.current"] == 16 * MIB
    a.free(keep)


def test_max_split_size_frees_a_cached_oversize_block_before_the_full_flush():
    a = alloc(capacity=120 * MIB, max_split_size=40 * MIB)
    a.free(a.malloc(70 * MIB))  # too large to reuse for 45 MiB (>= 45 + 20)
    a.free(a.malloc(3 * MIB))  # a cached unsplit 20 MiB segment the full flush would free
    a.malloc(45 * MIB)  # 30 MiB free: the 70 MiB oversize block is released first
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == 0
    assert sorted(size for _, size, _ in a.segments()) == [20 * MIB, 46 * MIB]


def test_releasing_too_few_oversize_blocks_falls_through_to_the_full_flush():
    a = alloc(capacity=120 * MIB, max_split_size=40 * MIB)
    a.free(a.malloc(50 * MIB))
    a.free(a.malloc(3 * MIB))
    a.malloc(60 * MIB)  # freeing the 50 MiB block alone is not enough
    assert a.memory_stats()["num_alloc_retries"] == 1
    assert [size for _, size, _ in a.segments()] == [60 * MIB]


def test_empty_cache_releases_only_unsplit_segments():
    a = alloc()
    a.malloc(1000)  # keeps its small segment split
    a.free(a.malloc(5 * MIB))
    a.empty_cache()
    assert a.reserved_bytes == 2 * MIB


def test_peaks_reset_to_current():
    a = alloc()
    a.free(a.malloc(12 * MIB))
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 12 * MIB
    a.reset_peak_memory_stats()
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 0
    assert stats["reserved_bytes.all.peak"] == 12 * MIB


def test_allocated_and_freed_totals_count_every_change():
    a = alloc()
    x = a.malloc(1000)  # 1 KiB of a new 2 MiB small segment; the rest is split off
    y = a.malloc(12 * MIB)  # a new 12 MiB large segment, used whole
    a.free(x)  # merges back into one unsplit 2 MiB block
    a.free(y)
    a.malloc(1000)  # splits the small segment again
    a.reset_peak_memory_stats()
    stats = a.memory_stats()
    rest = 2 * MIB - 1024

    def stat(name):
        return {
            pool: tuple(stats[f"{name}.{pool}.{f}"] for f in ("current", "peak", "allocated", "freed"))
            for pool in ("all", "small_pool", "large_pool")
        }

    assert stat("allocation") == {"all": (1, 1, 3, 2), "small_pool": (1, 1, 2, 1), "large_pool": (0, 0, 1, 1)}
    assert stat("active") == stat("allocation")
    assert stat("allocated_bytes") == {
        "all": (1024, 1024, 12 * MIB + 2048, 12 * MIB + 1024),
        "small_pool": (1024, 1024, 2048, 1024),
        "large_pool": (0, 0, 12 * MIB, 12 * MIB),
    }
    assert stat("requested_bytes")["all"] == (1000, 1000, 12 * MIB + 2000, 12 * MIB + 1000)
    assert stat("inactive_split") == {"all": (1, 1, 2, 1), "small_pool": (1, 1, 2, 1), "large_pool": (0, 0, 0, 0)}
    assert stat("inactive_split_bytes")["small_pool"] == (rest, rest, 2 * rest, rest)
    assert stat("segment") == {"all": (2, 2, 2, 0), "small_pool": (1, 1, 1, 0), "large_pool": (1, 1, 1, 0)}
    assert [stats[f"oversize_allocations.{f}"] for f in ("current", "peak", "allocated", "freed")] == [0, 0, 0, 0]


def test_memory_stats_use_torch_key_names():
    stats = alloc().memory_stats()
    for key in (
        "allocated_bytes.all.current",
        "reserved_bytes.all.peak",
        "inactive_split_bytes.all.current",
        "allocation.small_pool.allocated",
        "segment.large_pool.freed",
        "active_bytes.all.current",
        "requested_bytes.all.peak",
        "oversize_allocations.current",
        "oversize_segments.peak",
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ):
        assert key in stats, key
    assert stats["max_split_size"] == -1
    assert len([k for k in stats if k.count(".") == 2]) == 9 * 3 * 4


def test_expandable_segments_map_20_mib_pages_at_adjacent_addresses():
    a = alloc(expandable_segments=True)
    x = a.malloc(3 * MIB)
    y = a.malloc(30 * MIB)
    assert y == x + 3 * MIB
    assert a.reserved_bytes == 40 * MIB  # 33 MiB in 20 MiB pages
    assert len(a.segments()) == 1


def test_expandable_segments_unmap_free_pages_on_empty_cache():
    a = alloc(expandable_segments=True)
    x = a.malloc(3 * MIB)
    y = a.malloc(30 * MIB)
    a.free(y)
    a.empty_cache()
    assert a.reserved_bytes == 20 * MIB  # the page holding x stays mapped
    assert a.device.free_bytes == (1 << 30) - 20 * MIB
    a.free(x)


def test_expandable_segments_reuse_the_freed_tail_by_remapping():
    a = alloc(capacity=60 * MIB, expandable_segments=True)
    a.free(a.malloc(50 * MIB))  # 60 MiB mapped, all free
    a.malloc(55 * MIB)  # fits in the mapped pages: no new mapping
    assert a.reserved_bytes == 60 * MIB
    assert a.memory_stats()["num_alloc_retries"] == 0


def test_device_free_memory_follows_reserved_segments():
    a = alloc(capacity=100 * MIB)
    a.malloc(12 * MIB)
    assert a.device.mem_get_info() == (88 * MIB, 100 * MIB)


# ---------------------------------------------------------------- rules from CUDACachingAllocator.cpp @ 001074d2


def test_roundup_power2_divisions_rounds_to_the_next_of_n_steps_between_powers_of_two():
    # round_size: 1.2 MiB lies between 1 and 2 MiB; with 4 divisions the steps are 1, 1.25, 1.5,
    # 1.75 MiB, so it becomes 1.25 MiB. The interval of sizes 1-2 MiB is the one keyed "1".
    a = alloc(roundup_power2_divisions={"1": 4})
    assert a.round_size(1200 * 1024) == 1280 * 1024
    assert a.round_size(1024 * 1024 + 1) == 1280 * 1024
    # A power of two is kept; the 2-4 MiB interval has no divisions: plain 512-byte rounding.
    assert a.round_size(1 << 20) == 1 << 20
    assert a.round_size(3 * MIB + 1) == 3 * MIB + 512
    # Sizes up to 512 x divisions are not rounded by divisions (size > kMinBlockSize * divisions).
    b = alloc(roundup_power2_divisions=8)
    assert b.round_size(4000) == 4096 and b.round_size(4097) == 4608


def test_roundup_power2_divisions_from_a_snapshot_settings_dict():
    from kvguard.allocators.torch_alloc import roundup_divisions_table

    table = roundup_divisions_table({"1": 0, "2": 2, "32768": 16})
    assert table[0] == 0 and table[1] == 2 and table[15] == 16
    with pytest.raises(ValueError):
        roundup_divisions_table({"3": 2})


def test_garbage_collection_needs_a_memory_fraction():
    a = alloc(capacity=1 << 30, garbage_collection_threshold=0.5)
    for size in (100 * MIB, 200 * MIB):
        a.free(a.malloc(size))
    a.malloc(300 * MIB)  # misses the cache, no fraction set: nothing is collected
    assert a.memory_stats()["num_device_free"] == 0


def test_garbage_collection_releases_old_cached_blocks_above_the_threshold():
    a = alloc(capacity=1 << 30, garbage_collection_threshold=0.5)
    a.set_memory_fraction(1.0)  # allowed maximum 1 GiB, threshold 512 MiB
    old = a.malloc(300 * MIB)
    young = a.malloc(250 * MIB)
    a.free(a.malloc(30 * MIB))
    a.free(old)
    for _ in range(3):  # three large-pool look-ups, served by the 30 MiB block, age `old`
        a.free(a.malloc(12 * MIB))
    a.free(young)
    # 580 MiB reserved > 512 MiB. The miss for 400 MiB is the fourth look-up: ages are old 4,
    # young 1, the 30 MiB block 1; the average is 2, so only `old` goes, which reclaims enough.
    a.malloc(400 * MIB)
    assert sorted(size for _, size, _ in a.segments()) == [30 * MIB, 250 * MIB, 400 * MIB]
    assert a.memory_stats()["num_device_free"] == 1


def test_memory_fraction_caps_reserved_memory():
    a = alloc(capacity=1 << 30)
    a.set_memory_fraction(0.5)
    a.malloc(400 * MIB)
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(200 * MIB)


def test_expandable_segments_do_not_count_as_segments():
    a = alloc(expandable_segments=True)
    a.malloc(30 * MIB)
    a.malloc(100)
    stats = a.memory_stats()
    assert stats["segment.all.current"] == 0
    assert stats["reserved_bytes.all.current"] == 40 * MIB + 2 * MIB


def test_empty_cache_releases_a_wholly_unmapped_expandable_segment():
    a = alloc(expandable_segments=True)
    a.free(a.malloc(30 * MIB))
    assert len(a.segments()) == 1
    a.empty_cache()
    assert a.segments() == []
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_blocks_are_not_shared_across_streams():
    a = alloc()
    a.free(a.malloc(12 * MIB, stream=1))
    got = a.malloc(12 * MIB, stream=2)
    assert len(a.segments()) == 2 and a.block_at(got).stream == 2


def test_segment_layout_is_snapshot_segments_reduced_to_what_an_end_state_compares():
    # Expandable: freeing the middle tensor and emptying the cache unmaps its pages, which splits
    # the segment into two mapped ranges; a non-expandable run keeps one range per segment.
    for expandable in (True, False):
        a = alloc(expandable_segments=expandable)
        addrs = [a.malloc(size) for size in (30 * MIB, 50 * MIB, 30 * MIB, 100)]
        a.free(addrs[1])
        a.empty_cache()
        want = [
            (s["address"], s["total_size"], tuple((b["address"], b["size"], b["allocated"]) for b in s["blocks"]))
            for s in a.snapshot_segments()
        ]
        assert a.segment_layout() == want
        assert (len(want), len(a.segments())) == ((3, 2) if expandable else (3, 3))


# ----------------------------------------------------------------- torch_npu's own rules
# (NPUCachingAllocator.cpp / NPUAllocatorConfig.{h,cpp} at Ascend/pytorch v26.2.0-beta.1-pytorch2.13.0;
# tests/upstream/test_oracle_torch_npu.py checks the same rules against the compiled allocator.)


def test_torch_npu_hands_out_null_for_zero_bytes_and_allocates_nothing():
    a = alloc(variant="torch_npu")
    assert a.malloc(0) == 0
    a.free(0)
    assert (a.allocated_bytes, a.reserved_bytes, a.segments()) == (0, 0, [])


def test_without_the_pad_on_ascend950_torch_npu_rounds_like_torch():
    a = alloc(variant="torch_npu", add_pad_size=False)
    assert block_size(a, a.malloc(512)) == 512  # with the pad: 544 -> 1024
    assert block_size(a, a.malloc(1 * MIB)) == 1 * MIB


def test_expandable_torch_npu_moves_a_large_request_up_to_a_16_kib_boundary():
    a = alloc(variant="torch_npu", expandable_segments=True)
    first = a.malloc(3 * MIB // 2 + 100)  # 1572996 padded -> a 1573376-byte block
    second = a.malloc(4 * MIB)
    # The free rest of the 20 MiB page starts at 1573376 = 96 x 16384 + 512: the request moves up
    # to 97 x 16384 = 1589248 and the 15872 bytes before it stay behind as a free block.
    assert second - first == 97 * 16384
    assert 15872 in a.free_block_sizes(small=False)


def test_base_addr_aligned_kb_zero_places_the_request_where_it_was_found():
    a = alloc(variant="torch_npu", expandable_segments=True, base_addr_aligned_kb=0)
    first = a.malloc(3 * MIB // 2 + 100)
    assert a.malloc(4 * MIB) - first == 1573376


def test_requests_under_2_mib_are_not_moved():
    a = alloc(variant="torch_npu", expandable_segments=True)
    first = a.malloc(3 * MIB // 2 + 100)
    assert a.malloc(3 * MIB // 2) - first == 1573376


def test_large_segment_size_sizes_segments_for_requests_under_10_mib():
    a = alloc(variant="torch_npu", large_segment_size=48 * MIB, add_pad_size=False)
    a.malloc(12 * MIB)  # from 10 MiB: still the request rounded to 2 MiB
    a.malloc(5 * MIB)
    assert sorted(size for _, size, _ in a.segments()) == [12 * MIB, 48 * MIB]


def test_segment_size_sets_the_expandable_large_page():
    a = alloc(variant="torch_npu", expandable_segments=True, segment_size=64 * MIB)
    a.malloc(5 * MIB)
    assert a.reserved_bytes == 64 * MIB


def test_large_segment_size_wins_over_segment_size_for_the_expandable_page():
    a = alloc(variant="torch_npu", expandable_segments=True, segment_size=64 * MIB, large_segment_size=32 * MIB)
    a.malloc(5 * MIB)
    assert a.reserved_bytes == 32 * MIB


def test_1g_pages_round_large_segments_up_to_1_gib():
    a = alloc(4 << 30, variant="torch_npu", page_size_1g=True)
    a.malloc(30 * MIB)
    a.malloc(1000)  # the small pool keeps 2 MiB segments
    assert sorted(size for _, size, _ in a.segments()) == [2 * MIB, 1 << 30]


def test_max_non_split_rounding_size_lets_an_oversize_request_take_a_larger_cached_block():
    for rounding, reused in ((None, False), (50 * MIB, True)):
        a = alloc(
            variant="torch_npu", max_split_size=100 * MIB, max_non_split_rounding_size=rounding, add_pad_size=False
        )
        a.free(a.malloc(200 * MIB))
        a.malloc(160 * MIB)  # 200 MiB >= 160 + 20 MiB, but < 160 + 50 MiB
        assert (a.reserved_bytes == 200 * MIB) is reused


def test_a_memory_fraction_given_at_construction_caps_reserved_memory():
    a = alloc(1 << 30, variant="torch_npu", memory_fraction=0.5)
    a.malloc(500 * MIB)
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(100 * MIB)


def test_throw_on_npumalloc_oom_refuses_a_segment_past_the_device_without_emptying_the_cache():
    for throw, reserved_after, ooms in ((False, 700 * MIB, 0), (True, 600 * MIB, 0)):
        a = alloc(1 << 30, variant="torch_npu", add_pad_size=False, throw_on_npumalloc_oom=throw)
        a.free(a.malloc(600 * MIB))  # cached
        if throw:  # 600 + 700 MiB > 1 GiB: refused, cache kept
            with pytest.raises(AllocatorOutOfMemory):
                a.malloc(700 * MIB)
        else:  # the device refuses; the cache is emptied, then it fits
            a.malloc(700 * MIB)
        assert (a.reserved_bytes, a.num_ooms) == (reserved_after, ooms)


def test_torch_npu_only_options_are_refused_for_plain_torch():
    with pytest.raises(ValueError, match="torch_npu"):
        alloc(base_addr_aligned_kb=0)
