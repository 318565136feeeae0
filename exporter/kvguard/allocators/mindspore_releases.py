"""MindSpore's Ascend memory pool, release by release: the rules as data, each cited.

Citations are ``path:line @ ref`` in the GitHub mirror ``mindspore-ai/mindspore_test``
(``git show REF:PATH``). Abbreviations: ``POOL`` = the ``abstract_dynamic_mem_pool.cc`` of
that ref (``backend/common/mem_reuse/`` to 2.5, ``memory/mem_pool/`` from 2.6), ``SUPPORT`` =
``abstract_ascend_memory_pool_support.cc`` (``plugin/device/ascend/hal/device/`` to 2.5,
``plugin/res_manager/ascend/mem_manager/`` from 2.6), ``VMM`` = ``ascend_vmm_adapter.h`` /
``.cc`` beside it, ``STATS`` = ``pybind_api/hal/memory_py.cc``, ``ASCEND_POOL`` =
``ascend_memory_pool.cc``, ``UTILS`` = ``mindspore/core/utils/ms_utils.cc``.

The mirror has tags v2.4.0, v2.4.1, v2.4.10, v2.5.0 and v2.6.0 only. Later releases are
read from the nearest source and checked, where a wheel shows it, against the PyPI wheel's
own strings (``_c_expression*.so``): each row's ``source_note`` says which.

Rules common to every row (2.4.0 ... r2.7.rc1 hold the same lines):

- sizes aligned to 512 bytes, 0 becoming 512 (``kDynamicMemAlignSize``,
  ``include/backend/mem_reuse/dynamic_mem_pool.h:153-158 @ v2.5.0``);
- the default unit is 1 GiB (``kDynamicMemAllocUnitSize = 1024 << 20``,
  ``dynamic_mem_pool.h:43 @ v2.4.0``, ``:44 @ v2.5.0, v2.6.0, r2.7.rc1``) for both pools,
  or 8 MiB for both in a graph run (``ASCEND_COMMON_POOL_ALLOC_UNIT_SIZE_FOR_GRAPH_RUN_MODE``,
  ``SUPPORT:35 @ v2.4.0``, ``:37 @ v2.5.0+``; the condition differs, ``small_unit_rule``);
- a configured unit (``set_context(mempool_block_size="NGB")``, ``set_memory(increase_size=)``;
  vllm-mindspore turns ``MS_MEMPOOL_BLOCK_SIZE=N`` into the former) is used for the common
  pool only when it differs from the 1.0 GB default, capped at free − 1 GiB ("Reserve 1G
  for persistent_mem", ``SUPPORT:50-55 @ v2.4.0``, ``:52-57 @ v2.5.0, v2.6.0, r2.7.rc1``);
  the persistent unit stays 1 GiB;
- a block is the unit grown by adding units under task sink, by doubling otherwise
  (``SUPPORT:110-119 @ v2.4.0``, ``:112-121 @ v2.5.0+``), at most the device's free memory,
  none when the request itself exceeds it (``SUPPORT:87 @ v2.4.0``, ``:89 @ v2.5.0+``);
- a persistent miss tries the common pool when VMM is off (``POOL:381 @ v2.4.0``,
  ``:430 @ v2.5.0``, ``:502 @ v2.6.0``, ``:508 @ r2.7.rc1``); then, with VMM (or eager free),
  every idle buffer is eager-freed and the allocator retried (``POOL:393``, ``:443``, ``:515``,
  ``:521``); then the allocator expands;
- VMM: a block reserves ``max(block, total_mem_size)`` of address space (``POOL:620 @ v2.4.0``,
  ``:681 @ v2.5.0``, ``:753 @ v2.6.0``, ``:760 @ r2.7.rc1``); 2 MiB physical handles
  (``kDefaultAlignSize``, ``VMM.h:125 @ v2.4.0``, ``:128 @ v2.6.0``; ``vmm_align_size`` in
  MB changes it, a multiple of 2 MB) are mapped when a buffer is handed out, taken from the
  handle cache first, refused once the handles reach ``total_mem_size``; eager free unmaps
  whole pages into that cache, which keeps them physically allocated (``VMM.cc:107-200,
  220-263 @ b6f48709``); VMM's ``EmptyCache`` frees the cache (``VMM.cc:268-280``);
- the pool's budget (``total_mem_size``) is not the device's free memory but
  ``floor(free × 15/16)`` rounded down to 2 MiB, less 10 MiB (``kMSMemoryRatio``,
  ``kExtraReservedMemory``; ``ascend_memory_adapter.cc:128-130 @ v2.4.0``, ``:130-132 @ v2.5.0``,
  ``:135-137 @ v2.6.0, r2.7.rc1``), then rounded down to the VMM page under VMM (``:159-165 @
  r2.7.rc1``); without VMM a block comes out of what is left of it (``FreeDevMemSize``,
  ``ascend_dynamic_mem_adapter.cc:103 @ r2.7.rc1``), with VMM every block may use all of it
  (blocks are address space). The oracle's 2.7.0-2.10.0 wheels report 64,414,023,680 for 64 GiB;
- task sink (``MS_CTX_ENABLE_TASK_SINK``) defaults on (``core/utils/ms_context.cc:621 @ r2.7.rc1``);
  PyNative leaves it on and a jit_level O0 graph compile turns it off, so blocks grow by adding
  units until the first compile and by doubling after it (the oracle shows both);
- a free idle buffer too small for a request grows into an eager-free neighbour, mapping only
  the missing bytes (``SearchAvaliableMemBuf``, ``POOL:119-161 @ r2.7.rc1``; the 2.7.1 binary
  spells it ``SearchAvailableMemBuf``); a refused map keeps the handles it took, in the cache;
- VMM is on by default on 910B / 910_93 with a VMM-capable driver, off on other SoCs, off under
  jit_level O2 with GE kernels disabled; ``enable_vmm`` in MS_ALLOC_CONF overrides
  (``VMM.h:77-111 @ v2.4.0``, ``:82-116 @ v2.6.0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

MIB = 1 << 20
GIB = 1 << 30
ALIGN_BYTES = 512
DEFAULT_UNIT_BYTES = 1 * GIB  # kDynamicMemAllocUnitSize
GRAPH_RUN_UNIT_BYTES = 8 * MIB  # ASCEND_COMMON_POOL_ALLOC_UNIT_SIZE_FOR_GRAPH_RUN_MODE
PERSISTENT_RESERVE_BYTES = 1 * GIB  # "Reserve 1G for persistent_mem"
DEFAULT_MEMPOOL_BLOCK_GB = 1.0  # kDefaultMempoolBlockSize (ms_context.h:95 @ b6f48709)
VMM_PAGE_BYTES = 2 * MIB  # AscendVmmAdapter::kDefaultAlignSize
MS_MEMORY_RATIO = (15, 16)  # kMSMemoryRatio 0.9375 (ascend_memory_adapter.cc:34 @ r2.7.rc1)
HUGE_PAGE_BYTES = 2 * MIB  # kPerHugePageMemorySize (:36)
EXTRA_RESERVED_BYTES = 10 * MIB  # kExtraReservedMemory (:37)


def pool_budget_bytes(device_free_bytes: int, vmm_page_bytes: int | None = None) -> int:
    """``AscendMemAdapter::Initialize``: what MindSpore's pool may use of ``device_free_bytes``.

    ``floor(free × 15/16)`` down to 2 MiB, less 10 MiB (ascend_memory_adapter.cc:135-137 @ r2.7.rc1,
    the same lines at v2.4.0-v2.6.0), then down to the VMM page with VMM (:159-160) or 512 bytes
    without (:163-164, kAscendMemAlignSize). 0 when that leaves nothing.
    """
    ratio, whole = MS_MEMORY_RATIO
    used = device_free_bytes * ratio // whole // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES - EXTRA_RESERVED_BYTES
    align = vmm_page_bytes or ALIGN_BYTES
    return max(0, used // align * align)


@dataclass(frozen=True)
class MindSporeRelease:
    """One release's switches. Every field but ``version`` and the notes is a rule of the pool."""

    version: str
    source_ref: str  # the tag, branch or commit the rules were read at
    source_note: str  # "" when read at the release's own tag; else what was assumed
    # "graph_task_sink": 8 MiB units when execution mode is graph and task sink is on (SUPPORT:62 @ v2.4.0);
    # "ge_o2": 8 MiB units on the GE backend with GE kernels disabled, i.e. graph mode jit_level O2
    # (SUPPORT:62-66 @ r2.7.rc1), which the simulator reads as graph mode with task sink.
    small_unit_rule: str
    # A failed common-pool expansion retries in the persistent pool (POOL:449-452 @ v2.5.0).
    common_falls_back_to_persistent: bool
    # memory_stats(): ``total_allocatd_memory`` (STATS:54 @ v2.4.0) or ``total_allocated_memory``.
    allocated_key: str
    # ``commom_mem_pool_stats`` (STATS:65 @ v2.4.0 ... :103 @ r2.7.rc1) or ``common_mem_pool_stats``.
    common_pool_key: str
    # "temp" (2.4, 2.5): total_reserved = alloc_size_ (VMM: address space), max_allocated = the used
    # increase since reset (temp_peak_size_), max_reserved = alloc now − alloc at reset (POOL:950-966 @
    # v2.4.0, :1048-1064 @ v2.5.0). "iter" (2.6+): total_reserved = physical VMM handles when VMM is on,
    # max_* = absolute peaks since reset (POOL:1114-1133, 1208-1216 @ v2.6.0).
    stats_rule: str
    # empty_cache(): "none" (2.4, 2.5: a logged no-op, hal/memory.py:126 @ v2.4.0, runtime/memory.py:192-201
    # @ v2.5.0); "release" (2.6+: VMM eager-frees idle buffers and frees cached handles, otherwise whole
    # free blocks are released, ASCEND_POOL:74-93 @ v2.6.0).
    empty_cache_rule: str
    # MS_ALLOC_CONF keys the release looks up (ms_utils.h:69-77 @ v2.4.0, :73-83 @ r2.7.rc1).
    alloc_conf_keys: tuple[str, ...]
    cites: Mapping[str, str] = field(default_factory=dict)
    # The switches every release in the table shares (module docstring), named per row all the same.
    align_bytes: int = ALIGN_BYTES
    default_unit_bytes: int = DEFAULT_UNIT_BYTES
    graph_run_unit_bytes: int = GRAPH_RUN_UNIT_BYTES
    persistent_reserve_bytes: int = PERSISTENT_RESERVE_BYTES  # the cap: a configured unit <= free - this
    vmm_page_bytes: int = VMM_PAGE_BYTES  # default vmm_align_size
    vmm_default_on_910b: bool = True  # IsVmmEnabled without enable_vmm
    eager_free_on_miss: bool = True  # VMM: eager-free idle buffers, then retry
    # SearchAvaliableMemBuf: an idle buffer grows into its eager-free neighbour (POOL:118-160 @ v2.6.0,
    # :119-161 @ r2.7.rc1; absent from MemBufAllocator::Malloc at v2.4.0 :95 and v2.5.0 :98).
    grows_idle_into_eager_free: bool = True
    # The pool's mem_mapper lowers total_eager_free_memory by the size before it maps, so a refused map
    # lowers it too (POOL:644-647 @ v2.4.0, :705-708 @ v2.5.0, :777-780 @ v2.6.0, :784-787 @ r2.7.rc1; the
    # 2.7.0 binary does so, the oracle shows). The 2.7.1-2.10.0 binaries lower it only for a mapped buffer.
    eager_free_drops_on_refused_map: bool = False
    # total_idle_memory (MemStat::IdleSize): alloc - used up to 2.7.0 (the 2.7.0 wheel's
    # include/backend/mem_reuse/abstract_dynamic_mem_pool.h:174); alloc - used - eager free from 2.7.1
    # (the 2.7.1 wheel's include/runtime/memory/mem_pool/abstract_dynamic_mem_pool.h:176-178, 2.10.0's :296-298).
    idle_excludes_eager_free: bool = True

    def __post_init__(self) -> None:
        if self.small_unit_rule not in ("graph_task_sink", "ge_o2"):
            raise ValueError(f"{self.version}: unknown small_unit_rule {self.small_unit_rule!r}")
        if self.stats_rule not in ("temp", "iter") or self.empty_cache_rule not in ("none", "release"):
            raise ValueError(f"{self.version}: unknown stats or empty_cache rule")


_KEYS_24 = (
    "acl_allocator",
    "somas_whole_block",
    "enable_vmm",
    "vmm_align_size",
    "memory_recycle",
    "memory_tracker",
    "defrag_memory_step_freq",
    "older_pool",
)
_KEYS_27 = _KEYS_24 + ("simple_tracker", "memory_tracker_path")

_CITES_24 = {
    "align": "include/backend/mem_reuse/dynamic_mem_pool.h:41,133-138 @ v2.4.0 (kDynamicMemAlignSize 512)",
    "vmm_page": "VMM.h:47-57,125 @ v2.4.0",
    "eager_free": "POOL:388-395 @ v2.4.0",
    "unit": "include/backend/mem_reuse/dynamic_mem_pool.h:43 @ v2.4.0",
    "small_unit": "SUPPORT:35,60-66 @ v2.4.0",
    "cap": "SUPPORT:50-55 @ v2.4.0",
    "growth": "SUPPORT:108-122 @ v2.4.0",
    "persistent_to_common": "POOL:381 @ v2.4.0",
    "common_to_persistent": "absent: POOL:375-412 @ v2.4.0",
    "stats_keys": "STATS:53-66 @ v2.4.0",
    "stats_rule": "POOL:950-966,1041-1050 @ v2.4.0",
    "empty_cache": "hal/memory.py:126 @ v2.4.0 (not supported, a warning)",
    "vmm_default": "VMM.h:77-111 @ v2.4.0",
    "alloc_conf": "UTILS:60-100 @ v2.4.0 (';' -> ',', split on ',', key:value at the first ':')",
}
_CITES_25 = {
    "align": "include/backend/mem_reuse/dynamic_mem_pool.h:153-158 @ v2.5.0",
    "vmm_page": "VMM.h:47-57,123 @ v2.5.0",
    "eager_free": "POOL:437-445 @ v2.5.0",
    "unit": "include/backend/mem_reuse/dynamic_mem_pool.h:44 @ v2.5.0",
    "small_unit": "SUPPORT:37,62-68 @ v2.5.0",
    "cap": "SUPPORT:52-57 @ v2.5.0",
    "growth": "SUPPORT:110-124 @ v2.5.0",
    "persistent_to_common": "POOL:430 @ v2.5.0",
    "common_to_persistent": "POOL:449-455 @ v2.5.0",
    "stats_keys": "STATS:53-66 @ v2.5.0",
    "stats_rule": "POOL:1048-1064,1139-1148 @ v2.5.0",
    "empty_cache": "runtime/memory.py:192-201 @ v2.5.0 (not supported, a warning)",
    "vmm_default": "VMM.h:77-111 @ v2.5.0",
    "alloc_conf": "UTILS:60-105 @ v2.5.0",
}
_CITES_26 = {
    "align": "include/backend/mem_reuse/dynamic_mem_pool.h:153-158 @ v2.6.0",
    "vmm_page": "VMM.h:50-60,128 @ v2.6.0",
    "eager_free": "POOL:509-517 @ v2.6.0",
    "unit": "include/backend/mem_reuse/dynamic_mem_pool.h:44 @ v2.6.0",
    "small_unit": "SUPPORT:37,62-68 @ v2.6.0",
    "cap": "SUPPORT:52-57 @ v2.6.0",
    "growth": "SUPPORT:110-124 @ v2.6.0",
    "persistent_to_common": "POOL:502 @ v2.6.0",
    "common_to_persistent": "POOL:521-527 @ v2.6.0",
    "stats_keys": "STATS:79-92 @ v2.6.0",
    "stats_rule": "POOL:1114-1133,1208-1216 @ v2.6.0",
    "empty_cache": "ASCEND_POOL:74-93 @ v2.6.0",
    "vmm_default": "VMM.h:82-116 @ v2.6.0",
    "alloc_conf": "UTILS:69-110 @ v2.6.0",
}
_CITES_27 = {
    "align": "include/backend/mem_reuse/dynamic_mem_pool.h:153-158 @ r2.7.rc1",
    "vmm_page": "VMM.h:50-60,128 @ r2.7.rc1",
    "eager_free": "POOL:515-523 @ r2.7.rc1",
    "unit": "include/backend/mem_reuse/dynamic_mem_pool.h:44 @ r2.7.rc1",
    "small_unit": "SUPPORT:37,61-66 @ r2.7.rc1",
    "cap": "SUPPORT:52-57 @ r2.7.rc1",
    "growth": "SUPPORT:110-124 @ r2.7.rc1",
    "persistent_to_common": "POOL:508 @ r2.7.rc1",
    "common_to_persistent": "POOL:527-533 @ r2.7.rc1",
    "stats_keys": "STATS:91-104 @ r2.7.rc1",
    "stats_rule": "POOL:1121-1140,1215-1223 @ r2.7.rc1",
    "empty_cache": "ASCEND_POOL:75-94 @ r2.7.rc1",
    "vmm_default": "VMM.h:82-116 @ r2.7.rc1",
    "alloc_conf": "UTILS:69-110 @ r2.7.rc1",
}


def _row(
    version: str,
    ref: str,
    note: str,
    cites: Mapping[str, str],
    *,
    small: str,
    fallback: bool,
    allocated: str,
    common: str,
    stats: str,
    empty: str,
    keys: tuple[str, ...],
) -> MindSporeRelease:
    return MindSporeRelease(version, ref, note, small, fallback, allocated, common, stats, empty, keys, dict(cites))


_R27_NOTE = "no tag in the mirror: pool rules read at branch r2.7.rc1 (2025-07-05); "
_RELEASES: tuple[MindSporeRelease, ...] = (
    _row(
        "2.4.0",
        "v2.4.0",
        "",
        _CITES_24,
        small="graph_task_sink",
        fallback=False,
        allocated="total_allocatd_memory",
        common="commom_mem_pool_stats",
        stats="temp",
        empty="none",
        keys=_KEYS_24,
    ),
    _row(
        "2.4.1",
        "v2.4.1",
        "",
        {**_CITES_24, "stats_keys": "STATS:53-66 @ v2.4.1"},
        small="graph_task_sink",
        fallback=False,
        allocated="total_allocatd_memory",
        common="commom_mem_pool_stats",
        stats="temp",
        empty="none",
        keys=_KEYS_24,
    ),
    _row(
        "2.4.10",
        "v2.4.10",
        "",
        {**_CITES_24, "stats_keys": "STATS:53-66 @ v2.4.10"},
        small="graph_task_sink",
        fallback=False,
        allocated="total_allocatd_memory",
        common="commom_mem_pool_stats",
        stats="temp",
        empty="none",
        keys=_KEYS_24,
    ),
    _row(
        "2.5.0",
        "v2.5.0",
        "",
        _CITES_25,
        small="graph_task_sink",
        fallback=True,
        allocated="total_allocated_memory",
        common="commom_mem_pool_stats",
        stats="temp",
        empty="none",
        keys=_KEYS_24,
    ),
    _row(
        "2.6.0",
        "v2.6.0",
        "",
        _CITES_26,
        small="graph_task_sink",
        fallback=True,
        allocated="total_allocated_memory",
        common="commom_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_24,
    ),
    _row(
        "2.7.0",
        "r2.7.rc1",
        _R27_NOTE + "the 2.7.0 wheel's _c_expression spells commom_mem_pool_stats",
        _CITES_27,
        small="ge_o2",
        fallback=True,
        allocated="total_allocated_memory",
        common="commom_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_27,
    ),
    _row(
        "2.7.1",
        "r2.7.rc1",
        _R27_NOTE + "the 2.7.1 wheel's _c_expression spells commom_mem_pool_stats "
        "(vllm-mindspore 0.5.x pins an r2.7.1 build)",
        _CITES_27,
        small="ge_o2",
        fallback=True,
        allocated="total_allocated_memory",
        common="commom_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_27,
    ),
    _row(
        "2.7.2",
        "r2.7.rc1",
        _R27_NOTE + "keys as the 2.7.0 wheel (2.7.2 wheel not read)",
        _CITES_27,
        small="ge_o2",
        fallback=True,
        allocated="total_allocated_memory",
        common="commom_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_27,
    ),
    _row(
        "2.8.0",
        "r2.7.rc1",
        "no source in the mirror: pool rules assumed as r2.7.rc1; the 2.8.0 wheel's "
        "_c_expression spells common_mem_pool_stats",
        {**_CITES_27, "stats_keys": "wheel 2.8.0 strings"},
        small="ge_o2",
        fallback=True,
        allocated="total_allocated_memory",
        common="common_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_27,
    ),
    _row(
        "2.9.0",
        "r2.7.rc1",
        "no source in the mirror: pool rules assumed as r2.7.rc1; the 2.9.0 wheel's "
        "_c_expression spells common_mem_pool_stats",
        {**_CITES_27, "stats_keys": "wheel 2.9.0 strings"},
        small="ge_o2",
        fallback=True,
        allocated="total_allocated_memory",
        common="common_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_27,
    ),
    _row(
        "2.10.0",
        "r2.7.rc1",
        "no source in the mirror: pool rules assumed as r2.7.rc1; the 2.10.0 wheel's "
        "_c_expression spells common_mem_pool_stats and runtime/memory.py:132-136 shows it",
        {**_CITES_27, "stats_keys": "wheel 2.10.0 strings; runtime/memory.py:132-136"},
        small="ge_o2",
        fallback=True,
        allocated="total_allocated_memory",
        common="common_mem_pool_stats",
        stats="iter",
        empty="release",
        keys=_KEYS_27,
    ),
)

# The binary-read switches: before 2.6 no SearchAvaliableMemBuf; up to 2.7.0 the source's mapper bookkeeping.
_OLD_MAPPER = {"2.4.0", "2.4.1", "2.4.10", "2.5.0", "2.6.0", "2.7.0"}
RELEASES: tuple[MindSporeRelease, ...] = tuple(
    replace(
        row,
        grows_idle_into_eager_free=row.version not in ("2.4.0", "2.4.1", "2.4.10", "2.5.0"),
        eager_free_drops_on_refused_map=row.version in _OLD_MAPPER,
        idle_excludes_eager_free=row.version not in _OLD_MAPPER,
    )
    for row in _RELEASES
)

# The MindSpore build vllm-mindspore's seed fix ran on: vllm-mindspore master at PR !428 (f2b96744,
# 2025-05-28; !437 is not in the mirror) pins the master nightly of 2025-05-26, commit b6f48709
# (.jenkins/test/config/dependent_packages.yaml). That commit is in the mindspore_test mirror; its pool
# lines are v2.6.0's (POOL:501/514/521, 1114-1133 @ b6f48709; SUPPORT:52, 112-117), so it is the 2.6.0 row.
SEED_MINDSPORE = "2.6.0"
SEED_MINDSPORE_COMMIT = "b6f48709740e52a1daf206553f742609a0998bae"

BY_VERSION: dict[str, MindSporeRelease] = {row.version: row for row in RELEASES}


def release(version: str) -> MindSporeRelease:
    """The row for ``version`` ("2.5", "2.5.0" and "2.7.1.post1" find their release); ValueError otherwise."""
    text = str(version).strip()
    if text.endswith(".post1"):
        text = text[: -len(".post1")]
    if text.count(".") == 1:
        text += ".0"
    row = BY_VERSION.get(text)
    if row is None:
        raise ValueError(f"unknown MindSpore version {version!r} (known: {', '.join(BY_VERSION)})")
    return row


# ----------------------------------------------------------------- MS_ALLOC_CONF
@dataclass(frozen=True)
class AllocConf:
    """MS_ALLOC_CONF as MindSpore reads it: key -> value strings."""

    items: Mapping[str, str]

    def flag(self, key: str) -> bool | None:
        """``IsEnableAllocConfig`` / ``IsDisableAllocConfig``: True, False, or None (unset or other)."""
        value = self.items.get(key)
        if value in ("True", "true"):
            return True
        if value in ("False", "false"):
            return False
        return None

    @property
    def vmm_page_bytes(self) -> int:
        """``vmm_align_size`` in MB (a multiple of 2 MB), else 2 MiB (VMM.h:47-57 @ v2.5.0)."""
        value = self.items.get("vmm_align_size", "")
        if not value:
            return VMM_PAGE_BYTES
        digits = value.upper().removesuffix("MB").strip()
        if not digits.isdigit() or int(digits) <= 0 or int(digits) % 2:
            raise ValueError(f"MS_ALLOC_CONF vmm_align_size must be a positive multiple of 2 (MB), got {value!r}")
        return int(digits) * MIB


def parse_alloc_conf(text: str | None, mindspore: MindSporeRelease, *, strict: bool = True) -> AllocConf:
    """Parse MS_ALLOC_CONF the way ``Config::GetValue`` does (UTILS:60-100 @ v2.4.0, :69-110 @ v2.6.0).

    Matching quotes around the whole string are stripped, ';' counts as ',', each item is trimmed and
    split at its first ':' (items without one are ignored), key and value trimmed. MindSpore keeps
    keys it never looks up without a word; here an unknown key is an error, since it does nothing
    (vllm-mindspore 0.5's own ``derag_memory_step_freq`` is such a key: a misspelt
    ``defrag_memory_step_freq``). ``strict=False`` drops them, as MindSpore does (the launcher's
    default string is read that way).
    """
    if text is None:
        return AllocConf({})
    value = text.strip()
    while len(value) >= 2 and value[0] in "'\"" and value[0] == value[-1]:
        value = value[1:-1]
    items: dict[str, str] = {}
    for item in value.replace(";", ",").split(","):
        item = item.strip()
        if ":" not in item:
            continue
        key, _, val = item.partition(":")
        key, val = key.strip(), val.strip()
        if key not in mindspore.alloc_conf_keys:
            if not strict:
                continue
            raise ValueError(
                f"MS_ALLOC_CONF key {key!r} is not one MindSpore {mindspore.version} reads "
                f"(it would be ignored); known: {', '.join(mindspore.alloc_conf_keys)}"
            )
        items[key] = val
    return AllocConf(items)


def vmm_enabled(conf: AllocConf, *, soc_supports_vmm: bool = True, jit_o2_without_ge_kernel: bool = False) -> bool:
    """``AscendVmmAdapter::IsVmmEnabled`` (VMM.h:77-111 @ v2.4.0): O2 without GE kernels, then the
    explicit ``enable_vmm``, then on for 910B / 910_93 (``soc_supports_vmm``) with a VMM-capable driver."""
    if jit_o2_without_ge_kernel:
        return False
    explicit = conf.flag("enable_vmm")
    if explicit is not None:
        return explicit
    return soc_supports_vmm


# ----------------------------------------------------------------- vllm-mindspore launchers
@dataclass(frozen=True)
class VllmMindSporeLauncher:
    """What a vllm-mindspore release's launcher and worker set for MindSpore's pool."""

    version: str
    mindspore: str  # the MindSpore release whose rules apply
    ms_alloc_conf: str | None  # vllm_mindspore/scripts.py env_setup's MS_ALLOC_CONF (None: not set)
    cites: tuple[str, ...]


VLLM_MINDSPORE_LAUNCHERS: dict[str, VllmMindSporeLauncher] = {
    "0.5.1": VllmMindSporeLauncher(
        "0.5.1",
        "2.7.1",
        "enable_vmm: true, derag_memory_step_freq: -1",
        (
            "vllm_mindspore/scripts.py:52 @ v0.5.1 (wheel 0.5.1 and 0.5.0 identical)",
            ".jenkins/test/config/dependent_packages.yaml:2 @ v0.5.1: mindspore r2.7.1 build of 2025-12-29",
            "vllm_mindspore/utils.py:342 @ v0.5.1 set_context(jit_config={'jit_level': 'O0'}): PyNative "
            "context (MindSpore's default mode) with O0 jit graphs, kernel by kernel, task sink off",
            "vllm_mindspore/utils.py:350-352 @ v0.5.1 MS_MEMPOOL_BLOCK_SIZE=N -> mempool_block_size='NGB'",
        ),
    ),
    "0.2.0": VllmMindSporeLauncher(
        "0.2.0",
        SEED_MINDSPORE,
        None,
        (
            "vllm_mindspore/scripts.py:25-46 @ f2b96744 (PR !428, the seed fix): no MS_ALLOC_CONF",
            ".jenkins/test/config/dependent_packages.yaml:2 @ f2b96744: mindspore master 20250526 b6f48709",
            "vllm_mindspore/utils.py:231 @ f2b96744 set_context(jit_config={'jit_level': 'O0'})",
            "vllm_mindspore/utils.py:237-238 @ f2b96744 MS_MEMPOOL_BLOCK_SIZE=N -> mempool_block_size='NGB'",
        ),
    ),
}
DEFAULT_LAUNCHER = "0.5.1"
SEED_LAUNCHER = "0.2.0"


def vmm_on(
    ms_alloc_conf: str | None,
    *,
    launcher_vmm: bool | None = None,
    mindspore: str | MindSporeRelease | None = None,
    soc_supports_vmm: bool = True,
    jit_o2_without_ge_kernel: bool = False,
) -> bool:
    """Whether MindSpore's pool runs with VMM: the one rule the vLLM plugin, ``kvguard budget
    --allocator mindspore`` and the simulator call.

    ``ms_alloc_conf``: MS_ALLOC_CONF as the operator set it (None: unset). ``launcher_vmm``: what the
    release's launcher sets it to when it is unset (vllm-mindspore's env_setup sets only a variable not
    already set, scripts.py:55-58 @ 0.5.1): its era row's ``vmm_default`` (kvguard.vllm.eras); None, it sets
    nothing and MindSpore's own default applies. ``mindspore``: the MindSpore release (default: the one the
    default launcher pins). Then MindSpore's own parse (``parse_alloc_conf``, unknown keys ignored as
    MindSpore ignores them) and ``IsVmmEnabled`` (``vmm_enabled``): on for 910B / 910_93
    (``soc_supports_vmm``) unless ``enable_vmm`` says otherwise.
    """
    if ms_alloc_conf is None and launcher_vmm is not None:
        ms_alloc_conf = f"enable_vmm:{str(launcher_vmm).lower()}"
    if mindspore is None:
        mindspore = VLLM_MINDSPORE_LAUNCHERS[DEFAULT_LAUNCHER].mindspore
    row = mindspore if isinstance(mindspore, MindSporeRelease) else release(mindspore)
    conf = parse_alloc_conf(ms_alloc_conf, row, strict=False)
    return vmm_enabled(
        conf,
        soc_supports_vmm=soc_supports_vmm and row.vmm_default_on_910b,
        jit_o2_without_ge_kernel=jit_o2_without_ge_kernel,
    )
