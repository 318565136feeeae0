"""The C engine of MindSpore's pool model (``mindspore_native.NativeDynamicMemPool``) against the Python
model (``mindspore_pool.DynamicMemPool``), the specification: the same random op streams through both,
each on its own device, compared after every op (addresses, out-of-memory errors, ``memory_stats()``,
counters, peaks, buffers, blocks, the device, steady-state keys and cells), over every release row and
constructor option. ``tests/upstream/test_oracle_mindspore.py`` also runs the engine against MindSpore's own pool.
"""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip(
    "kvguard.allocators._cmspool",
    reason="the C engine is not built: KVGUARD_BUILD_EXT=1 python setup.py build_ext --inplace",
)

from kvguard.allocators.base import AllocatorOutOfMemory, record_steady, replay_steady  # noqa: E402
from kvguard.allocators.device import Device  # noqa: E402
from kvguard.allocators.mindspore_native import NativeDynamicMemPool, unsupported  # noqa: E402
from kvguard.allocators.mindspore_pool import DynamicMemPool  # noqa: E402
from kvguard.allocators.mindspore_releases import RELEASES  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
STEPS = 300


def free_for_budget(budget: int) -> int:
    """Device free memory whose pool budget is ``budget`` (a 2 MiB multiple)."""
    return -(-(budget + 10 * MIB) * 16 // 15)


def configurations() -> list[dict]:
    """Every release row, each with several seeded draws of the constructor options and a device size."""
    rng = random.Random(20261205)
    configs = []
    for row in RELEASES:
        for _ in range(5):
            configs.append(
                {
                    "version": row if rng.random() < 0.2 else row.version,  # a row is accepted too
                    "graph_mode": rng.random() < 0.4,
                    "task_sink": rng.random() < 0.5,
                    "mempool_block_size": rng.choice([None, None, 1 * GIB, 8 * MIB, 24 * MIB, 10_000_000, 3 * GIB]),
                    "enable_vmm": rng.random() < 0.5,
                    "vmm_page_bytes": rng.choice([None, None, 2 * MIB, 4 * MIB]),
                    "budget": rng.choice([40 * MIB, 200 * MIB, 900 * MIB, 1536 * MIB, 3 * GIB]),
                    "non_allocator": rng.choice([0, 0, 64 * MIB]),
                }
            )
    return configs


CONFIGS = configurations()


def build(cls, config: dict):
    device = Device(free_for_budget(config["budget"]) + config["non_allocator"], config["non_allocator"])
    options = {key: value for key, value in config.items() if key not in ("budget", "non_allocator")}
    return cls(device, **options)


def request_size(rng: random.Random, budget: int) -> object:
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.40:
        return rng.randint(1, 64 * 1024)
    if r < 0.80:
        return rng.randint(64 * 1024, budget // 8)
    if r < 0.97:
        return rng.randint(budget // 8, budget + budget // 4)
    return rng.choice([1 << 64, 1 << 70, (1 << 63) - 1, (1 << 62) + 1, budget * 100])


def observed(pool, device: Device) -> dict:
    """Everything the Python model exposes, read the same way from either engine."""
    return {
        "stats": pool.memory_stats(),
        "bytes": (pool.allocated_bytes, pool.reserved_bytes, pool.peak_allocated_bytes, pool.peak_reserved_bytes),
        "counters": (
            pool.alloc_size,
            pool.used_size,
            pool.eager_free_size,
            pool.physical_pages,
            pool.cached_pages,
            pool.num_ooms,
            pool._static_bytes,
            pool._next_addr,
            pool.total_mem_size,
            pool.free_mem_size,
            pool._peak_increase,
            pool._used_at_reset,
            pool._alloc_at_reset,
            pool._window_used,
            pool._window_reserved,
            dict(pool._units),
            pool.task_sink,
            pool.page,
            pool._max_pages,
        ),
        "blocks": (pool.block_sizes(False), pool.block_sizes(True)),
        "idle": (pool.idle_buffer_sizes(False), pool.idle_buffer_sizes(True)),
        "eager": (list(pool._allocators[False].eager), list(pool._allocators[True].eager)),
        "device": (device.allocator_bytes, device.non_allocator_bytes, device.peak_used_bytes, device.free_bytes),
    }


def outcome(call):
    try:
        return ("ok", call())
    except AllocatorOutOfMemory as exc:
        return ("oom", str(exc), exc.requested_bytes, exc.free_bytes, exc.allocator)
    except (TypeError, ValueError, KeyError) as exc:
        return (type(exc).__name__, str(exc))


def run_side_by_side(config: dict, seed: int, steps: int = STEPS) -> tuple[int, int]:
    """Drive both engines with one seeded stream; assert they agree after every op. Returns (ops, OOMs)."""
    rng = random.Random(seed)
    python, native = build(DynamicMemPool, config), build(NativeDynamicMemPool, config)
    budget = python.total_mem_size or MIB
    live: list[int] = []
    python_keys, native_keys = {}, {}
    key_classes: list[tuple[int, int]] = []
    ooms = 0
    for step in range(steps):
        r = rng.random()
        if live and r < 0.38:
            addr = live.pop(rng.randrange(len(live)))
            results = [outcome(lambda pool=pool: pool.free(addr)) for pool in (python, native)]
        elif r < 0.41:
            results = [outcome(pool.empty_cache) for pool in (python, native)]
        elif r < 0.43:
            results = [outcome(pool.reset_peak_memory_stats) for pool in (python, native)]
        elif r < 0.45:
            results = [outcome(pool.take_window_peaks) for pool in (python, native)]
        elif r < 0.46:
            results = [outcome(pool.jit_o0_compile) for pool in (python, native)]
        elif r < 0.47 and config["enable_vmm"]:  # what a miss does first (private: VMM only)
            results = [outcome(pool._eager_free_idle) for pool in (python, native)]
        elif r < 0.48:
            grow = rng.randint(0, budget // 4)
            results = [pool.device.grow_non_allocator(grow) for pool in (python, native)]
        elif r < 0.49:
            bad = rng.choice([-1, -513, -(1 << 70), 1.5, None, "512", [1]])
            results = [outcome(lambda pool=pool: pool.malloc(bad)) for pool in (python, native)]
        elif r < 0.50:
            unknown = rng.choice([12345, 1 << 44, float(live[0]) if live else 7, "x", 1 << 80])
            results = [outcome(lambda pool=pool: pool.free(unknown)) for pool in (python, native)]
        elif r < 0.52:
            results = [steady_round(pool, rng.getstate()) for pool in (python, native)]
            rng.random()
        else:
            size = request_size(rng, budget)
            persistent = rng.choice([False, False, False, True, 0, 1])
            results = [outcome(lambda pool=pool: pool.malloc(size, persistent)) for pool in (python, native)]
            if results[0][0] == "ok":
                live.append(results[0][1])
                assert python.buffer(results[0][1]).size == native.buffer(results[1][1]).size
            ooms += results[0][0] == "oom"
        assert results[0] == results[1], f"config {config}, seed {seed}, step {step}: {results}"
        seen = observed(python, python.device)
        assert seen == observed(native, native.device), f"config {config}, seed {seed}, step {step}"
        key_classes.append(
            (
                python_keys.setdefault(python.steady_state_key(), step),
                native_keys.setdefault(native.steady_state_key(), step),
            )
        )
    # Steady keys partition the states alike: equal for the native engine exactly when equal for the model.
    assert [p for p, _ in key_classes] == [n for _, n in key_classes]
    return steps, ooms


def steady_round(pool, state) -> tuple:
    """record_steady over a few mallocs and frees, then replay_steady twice: what the scenario does."""
    rng = random.Random()
    rng.setstate(state)
    sizes = [rng.randint(1, 4 * MIB) for _ in range(3)]

    def run():
        addrs = [pool.malloc(size) for size in sizes]
        for addr in addrs:
            pool.free(addr)

    try:
        recorded = record_steady(pool, run)
    except AllocatorOutOfMemory as exc:
        return ("oom", str(exc))
    replay_steady(pool, recorded, 2)
    counters, peaks = pool.steady_cells()
    return recorded, [getattr(obj, key) for obj, key in counters + peaks]


@pytest.mark.parametrize(
    "index",
    range(len(CONFIGS)),
    ids=[
        f"{getattr(c['version'], 'version', c['version'])}-{'vmm' if c['enable_vmm'] else 'novmm'}-{i}"
        for i, c in enumerate(CONFIGS)
    ],
)
def test_the_c_engine_equals_the_python_model_at_every_op(index):
    run_side_by_side(CONFIGS[index], seed=index)


def test_the_streams_reach_out_of_memory_often():
    # Refusals, retries and releases are where engines differ: the streams must reach them.
    total = sum(run_side_by_side(config, seed=100 + i, steps=150)[1] for i, config in enumerate(CONFIGS[::7]))
    assert total >= 60, total


def test_the_bench_trace_gives_the_same_addresses_and_statistics():
    rng = random.Random(0)
    python, native = DynamicMemPool(Device(1 << 40)), NativeDynamicMemPool(Device(1 << 40))
    live = []
    for _ in range(20_000):
        if live and (len(live) >= 256 or rng.random() < 0.5):
            addr = live.pop(rng.randrange(len(live)))
            python.free(addr)
            native.free(addr)
        else:
            size = rng.choice((4096, 65536, 512 * 1024, 3 << 20, 14 << 20, 58 << 20, 300 << 20)) + rng.randrange(4096)
            addr = python.malloc(size)
            assert native.malloc(size) == addr
            live.append(addr)
    assert python.memory_stats() == native.memory_stats()
    assert python.idle_buffer_sizes(False) == native.idle_buffer_sizes(False)


def test_an_idle_buffer_grows_into_the_whole_of_its_eager_free_neighbour():
    # SearchAvaliableMemBuf taking all of the neighbour: the neighbour leaves the block's buffer list.
    results = []
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB), enable_vmm=True)
        a, b, _ = pool.malloc(4 * MIB), pool.malloc(2 * MIB), pool.malloc(2 * MIB)
        pool.free(b)
        pool._eager_free_idle()  # [4, 6) MiB eager-free between two used buffers
        pool.free(a)
        grown = pool.malloc(6 * MIB)
        pool.free(grown)
        results.append((grown == a, observed(pool, pool.device)))
    assert results[0] == results[1] and results[0][0]


def test_malloc_takes_its_arguments_by_keyword_too():
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB))
        pool.malloc(size=1000, persistent=True)
        pool.malloc(1000, persistent=False)
        assert (pool.block_sizes(True), pool.block_sizes(False)) == ([GIB], [GIB])
        for args, kwargs in (((), {}), ((1, True, 2), {}), ((1,), {"size": 1}), ((1,), {"stream": 0})):
            with pytest.raises(TypeError):
                pool.malloc(*args, **kwargs)


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "size", [-1, -512, -(1 << 70), 1.5, 512.0, None, "512", [512], True, 1 << 64, 1 << 70, (1 << 63) - 1, 1 << 62]
)
def test_a_bad_size_is_refused_alike_and_changes_nothing(size):
    python, native = DynamicMemPool(Device(16 * GIB)), NativeDynamicMemPool(Device(16 * GIB))
    for pool in (python, native):
        pool.free(pool.malloc(1000))
    results = [outcome(lambda pool=pool: pool.malloc(size)) for pool in (python, native)]
    assert results[0] == results[1]
    assert observed(python, python.device) == observed(native, native.device)


def test_a_negative_size_is_refused_not_booked():
    # The model once took -512 as a request: allocated_bytes became -512 and a buffer outgrew its block.
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB))
        with pytest.raises(ValueError, match="negative size"):
            pool.malloc(-512)
        with pytest.raises(TypeError):
            pool.malloc(1.5)
        assert pool.allocated_bytes == 0 and pool.block_sizes(False) == []


@pytest.mark.parametrize("addr", [12345, (1 << 44) + 512, "x", None, 1 << 80, -1, 2.5])
def test_freeing_an_unknown_address_raises_the_same_key_error(addr):
    errors = []
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB))
        pool.malloc(1000)
        with pytest.raises(KeyError) as caught:
            pool.free(addr)
        errors.append(caught.value.args)
    assert errors[0] == errors[1]


@pytest.mark.parametrize("held", [0, 1])
def test_an_unhashable_address_raises_the_same_error(held):
    # dict.pop: KeyError from an empty dict, before hashing; TypeError (unhashable) otherwise.
    errors = []
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB))
        for _ in range(held):
            pool.malloc(1000)
        errors.append(outcome(lambda: pool.free([1])))
        errors.append(outcome(lambda: pool.buffer([1])))
    assert errors[:2] == errors[2:]


def test_a_float_equal_to_an_address_frees_it_as_the_dict_finds_it():
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB))
        pool.free(float(pool.malloc(1000)))
        assert pool.allocated_bytes == 0


@pytest.mark.parametrize("persistent", [None, 2, "yes"])
def test_an_unknown_persistent_flag_raises_the_same_key_error(persistent):
    errors = [
        outcome(lambda cls=cls: cls(Device(16 * GIB)).malloc(1000, persistent))
        for cls in (DynamicMemPool, NativeDynamicMemPool)
    ]
    assert errors[0] == errors[1] and errors[0][0] == "KeyError"


def test_the_constructors_refuse_the_same_arguments():
    for kwargs in ({"version": "9.9"}, {"mempool_block_size": 0}, {"vmm_page_bytes": 3 * MIB}):
        messages = []
        for cls in (DynamicMemPool, NativeDynamicMemPool):
            with pytest.raises(ValueError) as caught:
                cls(Device(16 * GIB), **kwargs)
            messages.append(str(caught.value))
        assert messages[0] == messages[1]


def test_unsupported_names_what_the_c_engine_leaves_to_the_python_model():
    assert unsupported() is None
    assert unsupported(version="2.4.0", enable_vmm=True, vmm_page_bytes=4 * MIB, mempool_block_size=3 * GIB) is None
    assert "mempool_block_size" in unsupported(mempool_block_size=2.5 * GIB)
    assert "capacity" in unsupported(device=Device(1 << 63))
    with pytest.raises(NotImplementedError):
        NativeDynamicMemPool(Device(1 << 63))


# ----------------------------------------------------------------- how callers use it
def test_malloc_and_free_are_c_methods():
    pool = NativeDynamicMemPool(Device(16 * GIB))
    assert type(pool.malloc).__name__ == type(pool.free).__name__ == "builtin_function_or_method"
    assert pool.name == "mindspore"


def test_a_watcher_can_wrap_malloc_on_the_instance():
    # guarded.BudgetWatch and the scenario's watched check set and pop malloc on the instance.
    pool = NativeDynamicMemPool(Device(16 * GIB))
    calls = []
    original = pool.malloc
    pool.malloc = lambda *args: calls.append(args) or original(*args)
    pool.free(pool.malloc(1000))
    assert calls == [(1000,)] and "malloc" in vars(pool)
    del pool.__dict__["malloc"]
    assert type(pool.malloc).__name__ == "builtin_function_or_method"


def test_the_serving_scenario_runs_the_same_on_both_engines(monkeypatch):
    from kvguard.allocators import native
    from kvguard.sim.scenario import ScenarioConfig, ServingScenario

    small = json.loads(
        (Path(__file__).resolve().parents[1] / "data" / "configs" / "qwen3-0.6b" / "config.json").read_text()
    )
    results = []
    for engine in ("python", "auto"):
        monkeypatch.setenv(native.ENV, engine)
        for conf in ("enable_vmm:true", "enable_vmm:false"):
            config = ScenarioConfig(
                model_config=small,
                device_memory_bytes=8 * GIB,
                gpu_memory_utilization=0.9,
                allocator="mindspore",
                requests=8,
                seed=1,
                ms_alloc_conf=conf,
            )
            scenario = ServingScenario(config)
            result = scenario.run()
            results.append((native.engine(scenario.allocator), result))
    engines = [engine for engine, _ in results]
    assert engines == ["python", "python", "c", "c"]
    for (_, python), (_, c) in zip(results[:2], results[2:]):
        assert {**python.to_dict(), "allocator_engine": None} == {**c.to_dict(), "allocator_engine": None}
        assert python.timeline == c.timeline


# ----------------------------------------------------------------- memory
def test_pools_free_their_memory_when_dropped():
    def churn():
        for i in range(200):
            pool = NativeDynamicMemPool(Device(64 * GIB), enable_vmm=i % 2 == 0)
            addrs = [pool.malloc(size) for size in (1000, 3 * MIB, 700 * MIB, 5 * GIB)]
            pool.free(addrs[1])
            pool.steady_state_key()
            pool.empty_cache()

    churn()
    gc.collect()
    gc.disable()  # reference counting alone frees a pool: it is in no cycle
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        churn()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    finally:
        gc.enable()
    # tracemalloc sees the engine's PyMem allocations: 200 pools leaking even their 64-byte slab table
    # would leave 12 KiB (a VMM block's page map alone is 30 KiB).
    assert after - before < 4096, after - before


# ----------------------------------------------------------------- reentrancy (review regressions)
class _ReentrantBlocks(NativeDynamicMemPool):
    """block_alloc_size, which the engine calls back during an expansion, mallocs again."""

    armed = False

    def block_alloc_size(self, size, persistent):
        if self.armed:
            self.armed = False
            self.malloc(2 * GIB)
        return NativeDynamicMemPool.block_alloc_size(self, size, persistent)


def test_a_malloc_from_inside_block_alloc_size_is_refused():
    # It used to append an eighth block past the block array's end (a heap overflow) and corrupt the pool.
    pool = _ReentrantBlocks(Device(64 * GIB))
    for _ in range(7):
        pool.malloc(900 * MIB)  # the block array (room for 8) keeps one free slot
    pool.armed = True
    with pytest.raises(RuntimeError, match="inside one of its own calls"):
        pool.malloc(900 * MIB)
    assert pool.block_sizes(False) == [GIB] * 7 and pool.allocated_bytes == 7 * 900 * MIB
    pool.free(pool.malloc(900 * MIB))  # the pool goes on as before


class _ReentrantDevice(Device):
    """A device whose malloc or free_bytes (called from inside the engine) runs ``hook`` once."""

    __slots__ = ("hook",)

    def _run_hook(self):
        hook, self.hook = getattr(self, "hook", None), None
        if hook is not None:
            hook()

    def malloc(self, size):
        self._run_hook()
        return Device.malloc(self, size)

    @property
    def free_bytes(self):
        self._run_hook()
        return Device.free_bytes.fget(self)


def _reinit(pool):
    pool.__init__(pool.device, enable_vmm=pool.enable_vmm)


@pytest.mark.parametrize(
    "vmm, hook",
    [
        (False, _reinit),  # used to free the blocks under the expansion (NULL store)
        (True, lambda pool: pool.empty_cache()),  # used to empty the idle list under the grow loop
        (True, lambda pool: pool.free(pool.held)),
        (True, lambda pool: pool._eager_free_idle()),
        (False, lambda pool: pool.malloc(1000)),
    ],
    ids=["init", "empty_cache", "free", "eager_free_idle", "malloc"],
)
def test_a_pool_change_from_inside_a_device_callback_is_refused(vmm, hook):
    device = _ReentrantDevice(16 * GIB)
    pool = NativeDynamicMemPool(device, enable_vmm=vmm)
    pool.held, grown = pool.malloc(4 * MIB), pool.malloc(4 * MIB)
    pool.free(grown)  # VMM: an idle buffer before the block's eager-free rest
    before = observed(pool, device)
    device.hook = lambda: hook(pool)
    with pytest.raises(RuntimeError, match="inside one of its own calls"):
        pool.malloc(12 * MIB if vmm else 2 * GIB)
    assert observed(pool, device) == before
    pool.free(pool.held)
    pool.empty_cache()


def test_an_address_whose_eq_changes_the_pool_frees_what_the_model_frees():
    # free() compares the key with the stored address, and __eq__ may allocate enough to grow the address
    # table: the engine used to free the buffer at the stale slot (another address) and keep this one.
    results = []
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(16 * GIB))
        target, more = pool.malloc(1000), []

        class Key:
            armed = True

            def __hash__(self):
                return hash(target)

            def __eq__(self, other):
                if Key.armed:
                    Key.armed = False
                    more.extend(pool.malloc(1000) for _ in range(200))
                return other == target

        pool.free(Key())
        with pytest.raises(KeyError):
            pool.free(target)
        for addr in more:
            pool.free(addr)
        results.append(observed(pool, pool.device))
    assert results[0] == results[1]


def test_a_persistent_flag_found_as_true_but_falsy_takes_the_models_fallbacks():
    # The model picks the allocator by dict lookup, then tests the flag's own truth for its fallbacks.
    class FalsyTrue:
        def __hash__(self):
            return 1

        def __eq__(self, other):
            return other is True or other == 1

        def __bool__(self):
            return False

    results = []
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        pool = cls(Device(3 * GIB))
        pool.malloc(10 * MIB, True)
        pool.malloc(1536 * MIB)
        pool.malloc(900 * MIB, FalsyTrue())
        results.append((outcome(lambda pool=pool: pool.malloc(200 * MIB, FalsyTrue())), observed(pool, pool.device)))
    assert results[0] == results[1] and results[0][0][0] == "oom"


# ----------------------------------------------------------------- 64-bit cells (review regressions)
def test_block_addresses_past_2_63_raise_and_leave_the_device_as_it_was():
    # 2.6+ without VMM: each malloc / free / empty_cache cycle moves the next block address on by about a
    # block. The fourth cycle passes 2**63: the engine raised only after the device had granted the block,
    # leaving the device's bytes, alloc_size and _static_bytes booked for a block it then dropped.
    device = Device((1 << 62) - 1)
    pool = NativeDynamicMemPool(device, task_sink=False)
    for _ in range(3):
        pool.free(pool.malloc(pool.total_mem_size // 2 + 1))
        pool.empty_cache()
    with pytest.raises(OverflowError, match="beyond 2\\*\\*63"):
        pool.malloc(pool.total_mem_size // 2 + 1)
    assert (device.allocator_bytes, pool.alloc_size, pool._static_bytes, pool.block_sizes(False)) == (0, 0, 0, [])


@pytest.mark.parametrize("version, size", [("2.7.1", 1 << 20), ("2.7.0", None)])
def test_vmm_counters_past_2_63_raise_instead_of_wrapping(version, size):
    # VMM on a full device: each miss adds a block of address space (alloc_size, eager_free_size), and in
    # 2.7.0 each refused map also lowers eager_free_size. The model's ints pass 2**63; the engine's cells
    # used to wrap silently. Now: equal to the model while they fit, then OverflowError. (2.7.1: the
    # expansion's sums are checked before anything moves, so the cells are as before the call; 2.7.0: the
    # drop that overflows comes after the same call's expansion, as a model exception mid-call would.)
    pools = []
    for cls in (DynamicMemPool, NativeDynamicMemPool):
        device = Device((1 << 62) - 1, (1 << 62) - 1 - (1 << 61))
        pool = cls(device, version=version, task_sink=False, enable_vmm=True, vmm_page_bytes=1 << 39)
        device.grow_non_allocator(device.free_bytes)
        pools.append(pool)
    python, native = pools
    request = size or python.total_mem_size

    def cells(pool):
        return (pool.alloc_size, pool.eager_free_size, pool._next_addr, pool.physical_pages, pool.cached_pages)

    overflowed = False
    for _ in range(12):
        before = cells(native)
        with pytest.raises(AllocatorOutOfMemory):
            python.malloc(request)
        try:
            native.malloc(request)
        except AllocatorOutOfMemory:
            assert cells(native) == cells(python)
        except OverflowError:
            overflowed = True
            assert any(abs(value) >= 1 << 63 for value in cells(python))
            assert cells(native) == before or version == "2.7.0"
            break
    assert overflowed


def test_a_device_reporting_negative_free_bytes_does_not_wrap_the_page_counts():
    # floor division of -2**63 negated it (undefined), and the page counts' byte products passed 2**63.
    class Liar(Device):
        __slots__ = ("report",)

        @property
        def free_bytes(self):
            return getattr(self, "report", Device.free_bytes.fget(self))

        def malloc(self, size):
            self.allocator_bytes += size
            return True

    for report in (-(1 << 63), -(1 << 62)):
        device = Liar(16 * GIB)
        pool = NativeDynamicMemPool(device, enable_vmm=True)
        device.report = report
        for _ in range(4):
            with pytest.raises((AllocatorOutOfMemory, OverflowError)):
                pool.malloc(MIB)
            assert pool.reserved_bytes == pool.physical_pages * pool.page
            assert pool.physical_pages - pool.cached_pages == 0


def test_the_writable_cells_refuse_values_whose_arithmetic_would_wrap():
    pool = NativeDynamicMemPool(Device(16 * GIB))
    pool.num_ooms = (1 << 63) - 1
    with pytest.raises(OverflowError):  # the model's num_ooms becomes 2**63; the cell cannot hold it
        pool.malloc(1 << 40)
    assert pool.num_ooms == (1 << 63) - 1
    with pytest.raises(ValueError):  # used_size - _used_at_reset would pass 2**63
        pool._used_at_reset = -(1 << 63)
    pool.reset_peak_memory_stats()
    assert pool._used_at_reset == 0


@pytest.mark.parametrize("value", [-5, -(3 << 20), (1 << 62) + 1, (1 << 63) - 1, 1 << 70])
@pytest.mark.parametrize("vmm", [False, True])
def test_a_block_alloc_size_override_outside_0_to_2_62_is_refused(value, vmm):
    # Without VMM the device was asked for a negative block (the model books it: allocated_bytes -5, and
    # the C engine's addresses differed) and 2**63 - 1 overflowed the address step; with VMM a negative
    # size reserves the budget, in the model and the engine alike.
    results = []
    for base in (DynamicMemPool, NativeDynamicMemPool):

        class Odd(base):
            def block_alloc_size(self, size, persistent):
                return value

        device = Device(16 * GIB)
        pool = Odd(device, enable_vmm=vmm)
        if base is NativeDynamicMemPool and (value > 1 << 62 or not vmm):
            with pytest.raises(ValueError, match="block_alloc_size"):
                pool.malloc(1000)
            assert (device.allocator_bytes, pool.alloc_size, pool._next_addr, pool.block_sizes(False)) == (
                0,
                0,
                1 << 44,
                [],
            )
        elif vmm and value < 0:
            results.append((outcome(lambda pool=pool: pool.malloc(1000)), observed(pool, device)))
    assert len(results) in (0, 2) and (not results or results[0] == results[1])


def test_a_page_of_2_40_bytes_or_more_is_left_to_the_python_model_whatever_its_type():
    from decimal import Decimal

    from kvguard.allocators._cmspool import Pool

    # A Decimal page passed the float / int screen: 2**62-byte pages overflowed the block address step.
    assert "VMM page" in unsupported(vmm_page_bytes=Decimal(1 << 62))
    assert unsupported(vmm_page_bytes=Decimal(4 * MIB)) is None
    for page, align in ((1 << 62, 512), (1 << 41, 512), (2 * MIB, 1 << 62)):
        with pytest.raises(ValueError, match="out of range"):
            Pool(Device(1 << 40), 1 << 39, page, align, True, True, True, True, True, True, True)
