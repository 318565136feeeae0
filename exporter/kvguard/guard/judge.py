"""The OOM guard: does the KV cache vLLM sized from the allocated peak fit the real headroom?

Pure logic: a rank's startup profile, the KV cache the engine allocated and the live allocator
counters in, a verdict with reasons out. No I/O; the budgets come from the estimator (one
definition of every formula).

The projection, per rank (docs/explanation/guard.md):

    projected peak = weights + KV cache allocated + reserved activation peak + non-torch increase
    headroom       = capacity − projected peak          (capacity: the profile's total memory)

vLLM sized the KV cache as ``total × util − (weights + allocated activation peak + non-torch)``,
so with the stock KV cache the headroom is ``total × (1 − util) − overcommit``: the allocator's
fragmentation (reserved − allocated peak) is paid out of the slack ``1 − util`` leaves, and the
rank runs out of memory when it is larger than that slack.

States: ``critical`` when the projected peak exceeds capacity or the allocator's retries / OOMs
climb; ``warning`` when the stock budget is overcommitted (or the live reserved peak outgrew the
projection, or the guard cannot judge); ``ok`` otherwise.

``judge_at_budget`` is the same verdict one step earlier: when vLLM has fixed its KV budget but
before the KV cache is allocated (docs/explanation/guard.md). It places the KV tensors, as
the era allocates them, into a fresh model of the rank's allocator (``kvguard.allocators``' rule-for-
rule models, built holding what the rank has reserved), then judges the state that leaves: a tensor the
model cannot place is ``kv_cache_placement_fails`` (critical); otherwise ``judge`` on the predicted
end-of-startup counters says whether the first serving peak fits.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Hashable, Iterable

from kvguard.allocators.base import Allocator, AllocatorOutOfMemory
from kvguard.allocators.mindspore_releases import VMM_PAGE_BYTES, pool_budget_bytes
from kvguard.budget.estimator import (
    Profile,
    non_kv_cache_bytes,
    overcommit_bytes,
    reserved_kv_cache_bytes,
    stock_kv_cache_bytes,
)
from kvguard.records import DeviceMemory, ReservedPeak, physical_reserved_bytes
from kvguard.units import format_gib
from kvguard.vllm import eras

OK, WARNING, CRITICAL = "ok", "warning", "critical"
STATES = (OK, WARNING, CRITICAL)
SEVERITY = {OK: 0, WARNING: 1, CRITICAL: 2}

# Reason codes; exported as a label value, so the set is fixed (docs/metrics.md).
OVERCOMMITTED = "overcommitted"
PEAK_EXCEEDS_CAPACITY = "projected_peak_exceeds_capacity"
RETRIES_CLIMBING = "alloc_retries_climbing"
OOMS_CLIMBING = "ooms_climbing"
LIVE_RESERVED_EXCEEDS = "live_reserved_exceeds_projection"
NO_PROFILE = "no_profile"
SNAPSHOT_STALE = "snapshot_stale"
KV_PLACEMENT_FAILS = "kv_cache_placement_fails"
PROFILE_FIELDS_UNKNOWN = "profile_fields_unknown"
# A reason a newer release wrote into a snapshot's budget-time verdict under a code this one does not know: kept
# with the state that release gave it, its own code at the head of the message.
REASON_UNKNOWN = "reason_unknown"
REASON_CODES = (
    OVERCOMMITTED,
    PEAK_EXCEEDS_CAPACITY,
    RETRIES_CLIMBING,
    OOMS_CLIMBING,
    LIVE_RESERVED_EXCEEDS,
    NO_PROFILE,
    SNAPSHOT_STALE,
    KV_PLACEMENT_FAILS,
    PROFILE_FIELDS_UNKNOWN,
    REASON_UNKNOWN,
)
# Not about one rank: the overall state when no rank was judged (/guard, /readyz, kvguard check).
NO_RANKS = "no_ranks"
_REASON_STATE = {
    OVERCOMMITTED: WARNING,
    PEAK_EXCEEDS_CAPACITY: CRITICAL,
    RETRIES_CLIMBING: CRITICAL,
    OOMS_CLIMBING: CRITICAL,
    LIVE_RESERVED_EXCEEDS: WARNING,
    NO_PROFILE: WARNING,
    SNAPSHOT_STALE: WARNING,
    NO_RANKS: WARNING,
    KV_PLACEMENT_FAILS: CRITICAL,
    PROFILE_FIELDS_UNKNOWN: WARNING,
    REASON_UNKNOWN: WARNING,  # unless the writer's stated state says more (Reason.stated)
}
BUDGET, RUNNING = "budget", "running"  # Verdict.phase: at the budget (before the KV cache), or after


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    stated: str | None = None  # REASON_UNKNOWN only: the state the newer release gave it

    @property
    def state(self) -> str:
        if self.code == REASON_UNKNOWN and self.stated in SEVERITY:
            return self.stated
        return _REASON_STATE[self.code]

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "state": self.state, "message": self.message}


@dataclass(frozen=True)
class GuardInput:
    """What the guard knows about one rank.

    ``kv_cache_bytes`` is what the engine allocated (blocks × block bytes); None means unknown,
    and the guard then takes the stock budget, which vLLM fills to within one block.
    ``alloc_retries_increase`` / ``ooms_increase`` are the counters' growth over the recent
    window (see CounterWindow); None means not measured.
    """

    profile: Profile | None
    kv_cache_bytes: int | None = None
    memory: DeviceMemory | None = None
    alloc_retries_increase: int | None = None
    ooms_increase: int | None = None
    snapshot_stale: bool = False
    kv_cache_outside_allocator: bool = False  # 0.34's extensible KV pages: in used memory, not in reserved
    # Why there is no profile, when the caller knows better than "none anywhere" (a startup log
    # that lacks some figures: one line naming them).
    no_profile_detail: str | None = None
    # vllm-mindspore: the profile run's reserved peak by MindSpore's statistics (the snapshot's).
    reserved_peak: ReservedPeak | None = None
    # Profile keys the writer set that this release does not know (kvguard.spool.schema.Snapshot's
    # ``profile_unknown_fields``): the verdict cannot count what they describe.
    unknown_profile_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    state: str
    reasons: tuple[Reason, ...]
    stock_budget_bytes: int | None = None
    reserved_budget_bytes: int | None = None
    reserved_budget_estimated: bool = False  # reserved peak inferred from live fragmentation
    overcommit_bytes: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_estimated: bool = False  # the stock budget stood in for the allocation
    activation_reserved_peak_bytes: int | None = None
    projected_peak_bytes: int | None = None
    capacity_bytes: int | None = None
    headroom_bytes: int | None = None
    phase: str = RUNNING
    # Budget time only: the KV tensors placed of those the era allocates, and what placing them cost
    # beyond their bytes (pool block tails, segment rounding), from the allocator model.
    kv_tensors: int | None = None
    kv_tensors_placed: int | None = None
    kv_placement_loss_bytes: int | None = None
    # vllm-mindspore: the reserved increase the engine measured at the profile run's end, MindSpore's
    # reserved peak of the run, and, where the guard counts the peak instead or cannot read it, why.
    reserved_increase_measured_bytes: int | None = None
    reserved_peak_increase_bytes: int | None = None
    reserved_peak_note: str | None = None

    @property
    def severity(self) -> int:
        return SEVERITY[self.state]

    @property
    def reason_codes(self) -> tuple[str, ...]:
        return tuple(r.code for r in self.reasons)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["reasons"] = [r.to_dict() for r in self.reasons]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Verdict":
        """Strict decoding of ``to_dict`` (a snapshot's budget-time verdict); ValueError when malformed."""
        if not isinstance(data, dict):
            raise ValueError("verdict is not an object")
        state, phase, raw = data.get("state"), data.get("phase", RUNNING), data.get("reasons")
        if state not in STATES or phase not in (BUDGET, RUNNING) or not isinstance(raw, list) or len(raw) > 16:
            raise ValueError("verdict state, phase or reasons malformed")
        reasons = []
        for item in raw:
            if not isinstance(item, dict) or not isinstance(item.get("message"), str):
                raise ValueError("verdict reason malformed")
            code = item.get("code")
            if code in _REASON_STATE:
                stated = item.get("state") if code == REASON_UNKNOWN else None
                reasons.append(Reason(code, item["message"][:1024], stated=stated))
            elif isinstance(code, str) and code and item.get("state") in SEVERITY:
                # A newer release's reason (kept, with its state, not dropped with the whole snapshot); its code
                # only as letters, digits and underscores, cut short.
                name = re.sub(r"[^a-z0-9_]", "?", code.lower()[:40])
                reasons.append(Reason(REASON_UNKNOWN, f"[{name}] " + item["message"][:1000], stated=item["state"]))
            else:
                raise ValueError("verdict reason malformed")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in ("state", "phase", "reasons"):
                continue
            value = data.get(f.name)
            if f.name == "reserved_peak_note":
                if value is not None and not isinstance(value, str):
                    raise ValueError("verdict field reserved_peak_note is not a string")
                values[f.name] = None if value is None else value[:1024]
            elif f.name.endswith("_estimated"):
                values[f.name] = value is True
            elif value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 1 << 63:
                    raise ValueError(f"verdict field {f.name} is not an integer")
                values[f.name] = value
        if _worst_state(r.state for r in reasons) != state:
            raise ValueError("verdict state does not follow from its reasons")
        return cls(state=state, reasons=tuple(reasons), phase=phase, **values)


def judge(inp: GuardInput) -> Verdict:
    """The verdict for one rank."""
    reasons: list[Reason] = []
    memory = inp.memory
    if inp.ooms_increase:
        reasons.append(
            Reason(
                OOMS_CLIMBING, f"the allocator raised {inp.ooms_increase} out-of-memory error(s) in the recent window"
            )
        )
    if inp.alloc_retries_increase:
        reasons.append(
            Reason(
                RETRIES_CLIMBING,
                f"the allocator flushed its cache and retried "
                f"{inp.alloc_retries_increase} allocation(s) in the recent window: "
                f"it is at the device's limit",
            )
        )
    if inp.snapshot_stale:
        reasons.append(Reason(SNAPSHOT_STALE, "the rank's latest snapshot is stale: the live counters may be old"))
    if inp.unknown_profile_fields and inp.profile is not None:
        reasons.append(
            Reason(
                PROFILE_FIELDS_UNKNOWN,
                f"the probe's profile has fields this kvguard does not know ({', '.join(inp.unknown_profile_fields)}): "
                f"judged without them, so the verdict may leave out memory they describe; run the sidecar of the "
                f"probe's kvguard release or a later one",
            )
        )

    profile = inp.profile
    if profile is None:
        reasons.append(
            Reason(
                NO_PROFILE,
                inp.no_profile_detail
                or "no startup profile for this rank (none in the snapshot, no --from-log): cannot judge the KV cache",
            )
        )
        return Verdict(state=_state(reasons), reasons=tuple(reasons), kv_cache_bytes=inp.kv_cache_bytes)

    stock = stock_kv_cache_bytes(profile)
    peak_note = reserved_peak_note(profile, inp.reserved_peak)
    peaked = with_reserved_peak(profile, inp.reserved_peak)
    peak_used = peaked is not profile  # the overcommit counts MindSpore's peak, not the engine's figure
    profile_for_reserved, estimated = _profile_with_reserved_peak(peaked, memory)
    reserved = reserved_kv_cache_bytes(profile_for_reserved) if profile_for_reserved else None
    kv_cache = inp.kv_cache_bytes if inp.kv_cache_bytes is not None else max(0, stock)
    over = overcommit_bytes(stock, reserved) if reserved is not None else None
    kv_over = overcommit_bytes(kv_cache, reserved) if reserved is not None else 0

    live_non_torch = _live_non_torch(memory)
    kv_outside = kv_cache if inp.kv_cache_outside_allocator else 0
    if live_non_torch is not None:
        # KV pages mapped outside the allocator are in the device's used memory: count them once.
        live_non_torch = max(0, live_non_torch - kv_outside)
    measured_non_kv = non_kv_cache_bytes(profile)
    # A profile given --kv-cache-memory-bytes may carry no more than the weights (required_fields): its
    # projection is the classic one, with what is unknown counted as nothing, so it is a floor, never an
    # all-clear: the rank is at least a warning, and critical where even the floor does not fit.
    if measured_non_kv is None:
        reasons.append(
            Reason(
                NO_PROFILE,
                "the startup profile holds no activation peak (given --kv-cache-memory-bytes, vLLM measures "
                "none): the projection counts weights, KV cache and live non-torch memory only, so the guard "
                "cannot say the KV cache fits",
            )
        )
    # A release whose profile run runs no sampler (vllm-ascend V1) measured a peak that a full batch's
    # sampling can pass: what it passes by is the next activation peak's too (Profile.unprofiled_sampler_bytes).
    sampler_excess = max(0, (profile.unprofiled_sampler_bytes or 0) - (profile.peak_allocated_increase_bytes or 0))
    if profile.unprofiled_sampler_bytes is None and not eras.profile_runs_sampler(profile.vllm_version):
        # Not given it (a log, an older plugin's snapshot, a profile file): the projection is a floor.
        reasons.append(
            Reason(
                NO_PROFILE,
                f"{profile.vllm_version}'s profile run samples nothing, and the profile does not carry the sampler "
                "peak a full batch reaches (the plugin records it): the projection leaves it out, so the guard "
                "cannot say the KV cache fits",
            )
        )
    if profile.budget_formula.non_kv == "peak" or measured_non_kv is None:
        activation = (
            profile_for_reserved.peak_reserved_increase_bytes
            if profile_for_reserved
            else profile.peak_allocated_increase_bytes
        )
        # A reserved increase below the allocated one means the profile run's activations lived in
        # memory the allocator already held idle (MindSpore: the weights' pool-block tails); once the
        # KV cache takes that memory, the next peak needs its allocated bytes anew.
        activation = max(activation or 0, profile.peak_allocated_increase_bytes or 0) + sampler_excess
        non_torch = profile.non_torch_increase_bytes or 0
        if live_non_torch is not None and live_non_torch > non_torch:
            # The profile holds the increase only; the runtime context and communication buffers
            # held from the start are memory too (device used minus allocator reserved).
            non_torch = live_non_torch
        projected = profile.weights_bytes + kv_cache + activation + non_torch
    elif profile.formula == "extensible":
        # 0.34's extensible KV cache, measured after warm-up (extensible_kv_cache.py 0.34.0:592-618): what
        # was in use at the init snapshot, the non-KV memory used since, the KV cache, and the larger of
        # the transient peak and torch's reserve growth, which vLLM keeps free.
        activation = max(profile.kv_transient_peak_bytes or 0, profile.torch_reserve_growth_bytes or 0) + sampler_excess
        non_torch = live_non_torch or 0
        init_free = profile.init_free_memory_bytes
        assert init_free is not None  # measured_non_kv is known, and it counts from init_free_memory_bytes
        projected = profile.total_memory_bytes - init_free + measured_non_kv + kv_cache + activation
    else:
        # 0.27+: what the era keeps out of the KV cache already holds weights and non-torch memory.
        base = profile_for_reserved or profile
        non_kv = non_kv_cache_bytes(base, reserved=profile_for_reserved is not None) or measured_non_kv
        activation = (base.transient_peak_headroom_bytes or 0) + sampler_excess
        non_torch = live_non_torch or 0
        projected = non_kv + kv_cache + (profile.cudagraph_memory_bytes or 0) + sampler_excess
    if memory is not None and memory.reserved_bytes is not None:
        # What the allocator holds now already includes weights and KV cache with every
        # rounding and packing loss; the next activation peak must fit on top of it, less
        # only the cached blocks it can reuse whole (not the slivers of split segments).
        held = physical_reserved_bytes(memory)
        live = held + non_torch + kv_outside + activation_growth_bytes(memory, activation, inp.snapshot_stale)
        if memory.peak_reserved_bytes is not None and held == memory.reserved_bytes:
            # (With MindSpore's VMM the reserved peak counts address space, not memory.)
            live = max(live, memory.peak_reserved_bytes + non_torch + kv_outside)
        if live > projected + capacity_tolerance(profile):
            peak = memory.peak_reserved_bytes or memory.reserved_bytes
            reasons.append(
                Reason(
                    LIVE_RESERVED_EXCEEDS,
                    f"the allocator's reserved memory "
                    f"({format_gib(memory.reserved_bytes)} now, peak "
                    f"{format_gib(peak)}) projects a peak "
                    f"{format_gib(live - projected)} above the "
                    f"startup profile's" + pool_credit_note(memory, inp.snapshot_stale),
                )
            )
        projected = max(projected, live)
    capacity = profile.total_memory_bytes
    headroom = capacity - projected
    pool_budget = mindspore_pool_budget(memory)
    pool_headroom = None
    if pool_budget is not None:
        # MindSpore's pool cannot grow past its budget, however much the device has free: the allocator's
        # part of the projection (everything but non-torch memory) must fit in it.
        pool_headroom = pool_budget - (projected - non_torch - kv_outside)
        headroom = min(headroom, pool_headroom)

    if kv_over and reserved is not None:  # (kv_over is 0 without a reserved budget)
        sized = (
            "the reserved memory left at the profile run's end, the pool reached a higher reserved peak during it"
            if peak_used
            else "the allocated peak, the allocator holds the reserved peak"
        )
        reasons.append(
            Reason(
                OVERCOMMITTED,
                f"the KV cache ({format_gib(kv_cache)}) exceeds the reserved-aware "
                f"budget ({format_gib(max(reserved, 0))}) by {format_gib(kv_over)}: "
                f"{_engine(profile) if peak_used else 'vLLM'} sized it from {sized}"
                + (" (reserved peak inferred from live fragmentation)" if estimated else ""),
            )
        )
    if (
        pool_budget is not None
        and pool_headroom is not None
        and pool_headroom < 0
        and pool_headroom <= capacity - projected
    ):
        reasons.append(
            Reason(
                PEAK_EXCEEDS_CAPACITY,
                f"projected pool peak {format_gib(pool_budget - pool_headroom)}"
                f" (weights + KV cache + reserved activation peak) exceeds "
                f"MindSpore's pool budget {format_gib(pool_budget)} (15/16 of "
                f"the memory free when the pool started, less 10 MiB) by "
                f"{format_gib(-pool_headroom)}" + pool_credit_note(memory, inp.snapshot_stale),
            )
        )
    elif headroom < 0:
        reasons.append(
            Reason(
                PEAK_EXCEEDS_CAPACITY,
                f"projected peak {format_gib(projected)} (weights + KV cache "
                f"+ reserved activation peak + non-torch"
                + (
                    f", with {format_gib(sampler_excess)} of sampling the profile run left out"
                    if sampler_excess
                    else ""
                )
                + ") exceeds the device's "
                f"{format_gib(capacity)} by {format_gib(-headroom)}" + pool_credit_note(memory, inp.snapshot_stale),
            )
        )
    return Verdict(
        state=_state(reasons),
        reasons=tuple(sorted(reasons, key=lambda r: -SEVERITY[r.state])),
        stock_budget_bytes=stock,
        reserved_budget_bytes=reserved,
        reserved_budget_estimated=estimated,
        overcommit_bytes=over,
        kv_cache_bytes=kv_cache,
        kv_cache_estimated=inp.kv_cache_bytes is None,
        activation_reserved_peak_bytes=activation if profile_for_reserved else None,
        projected_peak_bytes=projected,
        capacity_bytes=capacity,
        headroom_bytes=headroom,
        reserved_increase_measured_bytes=inp.reserved_peak.measured_increase_bytes if inp.reserved_peak else None,
        reserved_peak_increase_bytes=inp.reserved_peak.peak_increase_bytes if inp.reserved_peak else None,
        reserved_peak_note=peak_note,
    )


def with_reserved_peak(profile: Profile, reserved_peak: ReservedPeak | None) -> Profile:
    """The profile with MindSpore's reserved peak of the profile run as its reserved increase, where that
    peak was read and is above what the engine measured at the run's end (kvguard.records.ReservedPeak);
    else the profile as it is. Only the peak formulas take a reserved increase."""
    if reserved_peak is None or not reserved_peak.above_measured or profile.budget_formula.non_kv != "peak":
        return profile
    return replace(profile, peak_reserved_increase_bytes=reserved_peak.peak_increase_bytes)


def reserved_peak_note(profile: Profile | None, reserved_peak: ReservedPeak | None) -> str | None:
    """One line: why the guard counts MindSpore's reserved peak instead of the engine's end-of-run figure,
    or why it could not read that peak; None where the two agree (or the rank has no such record)."""
    if profile is None or reserved_peak is None or profile.budget_formula.non_kv != "peak":
        return None
    engine = _engine(profile)
    if reserved_peak.peak_increase_bytes is None:
        return (
            f"the profile run's reserved peak was not read from MindSpore ({reserved_peak.error or 'no reading'}): "
            f"the guard counts {engine}'s end-of-run reserved increase, which misses any blocks the pool released "
            f"during the run"
        )
    if not reserved_peak.above_measured:
        return None
    measured = reserved_peak.measured_increase_bytes
    return (
        f"the profile run's reserved peak (MindSpore max_memory_reserved) is "
        f"+{format_gib(reserved_peak.peak_increase_bytes)}, above the "
        f"+{format_gib(measured) if measured is not None else '?'} {engine} measured at the run's end "
        f"(its memory_reserved() before empty_cache): the pool released blocks during the run, so the "
        f"overcommit and the projection count the peak"
    )


def _engine(profile: Profile) -> str:
    """The engine that sized the KV cache, as the profile names it (``vllm-mindspore``); "vLLM" else."""
    project = (profile.vllm_version or "").partition(":")[0]
    return project if project and project != "vllm" else "vLLM"


@dataclass(frozen=True)
class BudgetInput:
    """What a rank knows when vLLM has fixed its KV budget, before the KV cache exists.

    ``kv_tensor_bytes``: the tensors the era will allocate for the cache, in order
    (``kvguard.budget.estimator.kv_cache_tensor_bytes``). ``build``: returns a new ``kvguard.allocators``
    allocator model (``CachingAllocator``, ``DynamicMemPool``) on its simulated device, holding
    what the rank has reserved now (``kvguard.sim.guarded``: a replay of the simulated rank's
    history, or ``allocator_from_counters`` for a real one). ``read``: the counters of a model, as
    the rank's source would report them (``kvguard.guard.at_budget.counters_of``).
    """

    profile: Profile
    kv_tensor_bytes: tuple[int, ...]
    build: Callable[[], Allocator]
    read: Callable[[Allocator], DeviceMemory]
    kv_cache_outside_allocator: bool = False
    reserved_peak: ReservedPeak | None = None  # vllm-mindspore: the profile run's reserved peak


def judge_at_budget(inp: BudgetInput) -> Verdict:
    """The budget-time verdict: does the KV cache the budget buys fit where the allocator will put
    it, and does the first serving peak fit beside it? Pure: the model is built for this call."""
    model = inp.build()
    reserved_before = physical_reserved_bytes(inp.read(model))
    tensors = inp.kv_tensor_bytes
    kv_cache = sum(tensors)
    placed, failure = 0, None
    if not inp.kv_cache_outside_allocator:
        for size in tensors:
            try:
                model.malloc(size)
            except AllocatorOutOfMemory as exc:
                failure = exc
                break
            placed += 1
    placed_bytes = sum(tensors[:placed])
    # Reserved growth beyond the tensors' bytes (rounding, block tails); 0 where they reused idle memory.
    memory = inp.read(model)
    loss = max(0, physical_reserved_bytes(memory) - reserved_before - placed_bytes)
    if failure is None:
        verdict = judge(
            GuardInput(
                inp.profile,
                kv_cache_bytes=kv_cache,
                memory=memory,
                kv_cache_outside_allocator=inp.kv_cache_outside_allocator,
                reserved_peak=inp.reserved_peak,
            )
        )
        return replace(
            verdict, phase=BUDGET, kv_tensors=len(tensors), kv_tensors_placed=placed, kv_placement_loss_bytes=loss
        )
    free = memory.free_bytes or 0
    short = sum(tensors[placed:]) - free
    verdict = judge(GuardInput(inp.profile, kv_cache_bytes=kv_cache, reserved_peak=inp.reserved_peak))
    reason = Reason(
        KV_PLACEMENT_FAILS,
        f"the KV cache ({format_gib(kv_cache)} in {len(tensors)} tensors of up to "
        f"{format_gib(max(tensors))}) does not fit where the allocator puts it: "
        f"tensor {placed + 1} fails with {format_gib(free)} free on the device "
        f"({placed} placed, {format_gib(loss)} reserved beyond their bytes for "
        f"rounding and block tails)",
    )
    headroom = min(verdict.headroom_bytes if verdict.headroom_bytes is not None else -short, -max(short, 1))
    capacity = inp.profile.total_memory_bytes
    return replace(
        verdict,
        state=CRITICAL,
        reasons=tuple(sorted((reason,) + verdict.reasons, key=lambda r: -SEVERITY[r.state])),
        phase=BUDGET,
        kv_tensors=len(tensors),
        kv_tensors_placed=placed,
        kv_placement_loss_bytes=loss,
        headroom_bytes=headroom,
        projected_peak_bytes=capacity - headroom,
    )


def largest_fitting_blocks(verdict_for: Callable[[int], Verdict | None], max_blocks: int) -> int:
    """The largest block count, at most ``max_blocks``, whose verdict (``verdict_for(blocks)``) is not
    critical; 0 when none is. Bisection: more blocks never make the verdict better."""
    first = verdict_for(max_blocks)
    if first is not None and first.state != CRITICAL:
        return max_blocks
    low, high = 0, max_blocks
    while high - low > 1:
        mid = (low + high) // 2
        verdict = verdict_for(mid)
        if verdict is not None and verdict.state != CRITICAL:
            low = mid
        else:
            high = mid
    return low


def capacity_tolerance(profile: Profile) -> int:
    """Allocator rounding below 1% of the device is noise, not a finding (the projection still counts it)."""
    return profile.total_memory_bytes // 100


def mindspore_pool_budget(memory: DeviceMemory | None) -> int | None:
    """What MindSpore's pool may hold at most, for a rank whose counters are the pool's.

    ``AscendMemAdapter::Initialize`` fixes the pool's budget (``total_mem_size``) at 15/16 of the
    memory free when the pool starts, down to 2 MiB, less 10 MiB (ascend_memory_adapter.cc:131-137
    @ r2.7.rc1; ``kvguard.allocators.mindspore_releases.pool_budget_bytes``, checked against the compiled
    pool). ``memory_stats()`` does not report it, so it is derived from the device's total less the
    memory held outside the pool now (``total_idle_memory`` in the counters marks the pool's). Memory
    that appeared outside the pool after it started makes the estimate smaller: it errs towards
    calling an OOM.
    """
    if memory is None or memory.idle_bytes is None or memory.total_bytes is None:
        return None
    outside = _live_non_torch(memory)
    if outside is None:
        return None

    return pool_budget_bytes(memory.total_bytes - outside)


def _live_non_torch(memory: DeviceMemory | None) -> int | None:
    """Device memory this process holds outside the framework allocator, when a source tells."""
    if memory is None or memory.reserved_bytes is None:
        return None
    held = memory.process_used_bytes if memory.process_used_bytes is not None else memory.used_bytes
    reserved = physical_reserved_bytes(memory)
    if held is None or held < reserved:
        return None
    return held - reserved


def _reusable_bytes(memory: DeviceMemory) -> int:
    """Cached memory the next activation peak can take whole (torch's caching allocator).

    The PyTorch caching allocator reports the free slivers of split segments as
    ``inactive_split``; only the rest of reserved − allocated is whole cached blocks. A source
    that does not report the split (MindSpore, device-level) gets no credit here: the guard errs
    towards calling an OOM (MindSpore's exact figures: :func:`activation_growth_bytes`).
    """
    fragmentation = memory.fragmentation_bytes
    if fragmentation is None or memory.inactive_split_bytes is None:
        return 0
    return max(0, fragmentation - memory.inactive_split_bytes)


def pool_figures_fresh(memory: DeviceMemory | None, snapshot_stale: bool = False) -> bool:
    """Whether MindSpore's exact pool figures (``DeviceMemory.reclaimable_bytes`` / ``largest_idle_bytes``)
    still describe the pool the counters describe.

    The pool writes its lists at ``DefragMemory`` (``DataPrepareActor::PreprocessBeforePrepareData``, before a
    graph run allocates anything: data_prepare_actor.cc:595, 1602-1613 @ r2.7.rc1), every
    ``defrag_memory_step_freq`` runs of a graph, so a dump is up to N runs old; the probe reads the counters
    between steps. Fresh means: the pool holds exactly the used bytes the lists held
    (``pool_figures_allocated_bytes == allocated_bytes``; between serving steps that is the weights, the KV
    cache and the graphs' persistent buffers, which a step does not change), and the snapshot is not stale.
    Not a wall-clock age: an idle engine runs no graph and writes no dump, and its pool does not change
    either, so its last figures stay true. The reader (kvguard.sources.mindspore_dump) takes only files
    this process wrote. What the rule cannot see: buffers freed and others allocated to the same total
    between the dump and the sample (docs/explanation/guard.md)."""
    if memory is None or snapshot_stale or memory.pool_figures_allocated_bytes is None:
        return False
    if memory.reclaimable_bytes is None and memory.largest_idle_bytes is None:
        return False
    return memory.allocated_bytes is not None and memory.pool_figures_allocated_bytes == memory.allocated_bytes


def activation_growth_bytes(memory: DeviceMemory, activation: int, snapshot_stale: bool = False) -> int:
    """What the next activation peak of ``activation`` bytes adds to what the allocator holds now.

    - torch: the peak less the whole cached blocks (:func:`_reusable_bytes`).
    - MindSpore with VMM and fresh exact figures: the peak in whole 2 MiB pages less ``reclaimable_bytes``.
      A miss eager-frees every idle buffer, unmapping only the pages no used buffer touches, and maps the
      request from that handle cache first (``AllocMemBuf`` abstract_dynamic_mem_pool.cc:515-524,
      ``MmapDeviceMem`` ascend_vmm_adapter.cc:107-189 @ r2.7.rc1); a page shared with a used buffer stays
      mapped and is no help to a request elsewhere.
    - MindSpore without VMM and fresh exact figures: nothing when the whole peak fits in the common
      pool's largest idle buffer (best fit serves it there, ``MemBufAllocator::Malloc``
      abstract_dynamic_mem_pool.cc:88-117), else the whole peak: a request larger than every idle
      buffer takes a new block (``CalMemBlockAllocSize``) and uses none of them.
    - MindSpore otherwise: the whole peak. ``memory_stats()`` is the same byte for byte for pool states
      where the next request fits and where it does not, with VMM on and off (docs/explanation/guard.md),
      so no credit is the only sound one.
    """
    activation = max(0, activation)
    if memory.reclaimable_bytes is not None or memory.largest_idle_bytes is not None:
        if not pool_figures_fresh(memory, snapshot_stale):
            return activation
        if memory.reclaimable_bytes is not None:
            pages = -(-activation // VMM_PAGE_BYTES) * VMM_PAGE_BYTES
            return max(0, pages - memory.reclaimable_bytes)
        largest_idle = memory.largest_idle_bytes
        assert largest_idle is not None  # one of the two figures is known, and it is not reclaimable_bytes
        return 0 if activation <= largest_idle else activation
    return max(0, activation - _reusable_bytes(memory))


def pool_credit_note(memory: DeviceMemory | None, snapshot_stale: bool = False) -> str:
    """The reason text's word on idle memory, for a MindSpore pool (empty for other allocators): which
    credit the projection took, or that it took none and why."""
    if memory is None or memory.idle_bytes is None or memory.inactive_split_bytes is not None:
        return ""
    idle = memory.fragmentation_bytes or 0
    if pool_figures_fresh(memory, snapshot_stale):
        if memory.reclaimable_bytes is not None:
            return (
                f"; credited {format_gib(memory.reclaimable_bytes)} the pool can unmap and reuse (whole 2 MiB "
                f"pages no used buffer touches, from MindSpore's memory dump)"
            )
        largest_idle = memory.largest_idle_bytes
        assert largest_idle is not None  # fresh figures hold reclaimable_bytes or largest_idle_bytes
        return (
            f"; the pool's largest idle buffer is {format_gib(largest_idle)} (MindSpore's "
            f"memory dump): the peak is credited it only when it fits there whole"
        )
    if not idle:
        return ""
    why = (
        "the pool's exact figures are older than its counters"
        if memory.pool_figures_allocated_bytes is not None
        else "memory_stats() cannot tell which of it the next peak can reuse"
    )
    return (
        f"; no credit for the pool's {format_gib(idle)} of idle memory ({why}; exact figures: KVGUARD_MINDSPORE_DUMP=1)"
    )


def _profile_with_reserved_peak(profile: Profile, memory: DeviceMemory | None) -> tuple[Profile | None, bool]:
    """The profile with a reserved activation peak: measured, or allocated peak + live fragmentation.

    vLLM's own logs never carry the reserved increase; the live gap between reserved and
    allocated is the best stand-in for what the allocator adds on top of the allocated peak.
    """
    if profile.budget_formula.non_kv != "peak":
        # 0.27+: the reserved twin is the transient peak; 0.34's extensible cache budgets it itself.
        if profile.reserved_transient_peak_bytes is not None or profile.formula == "extensible":
            return profile, False
        if memory is None or memory.fragmentation_bytes is None or profile.transient_peak_headroom_bytes is None:
            return None, False
        inferred = profile.transient_peak_headroom_bytes + memory.fragmentation_bytes
        return replace(profile, reserved_transient_peak_bytes=inferred), True
    if profile.peak_reserved_increase_bytes is not None:
        return profile, False
    if memory is None or memory.fragmentation_bytes is None or profile.peak_allocated_increase_bytes is None:
        return None, False
    inferred = profile.peak_allocated_increase_bytes + memory.fragmentation_bytes
    return replace(profile, peak_reserved_increase_bytes=inferred), True


def _worst_state(states: Iterable[str]) -> str:
    return max(states, key=SEVERITY.__getitem__, default=OK)


def _state(reasons: list[Reason]) -> str:
    return _worst_state(r.state for r in reasons)


# What the rank's own counters and snapshot say, whatever the projection: kept where another verdict stands for the
# rank (a budget-time verdict before its KV cache exists, :func:`standing`).
RANK_REASONS = frozenset((OOMS_CLIMBING, RETRIES_CLIMBING, SNAPSHOT_STALE, PROFILE_FIELDS_UNKNOWN))


def standing(live: Verdict, at_budget: Verdict | None, kv_cache_exists: bool) -> Verdict:
    """The verdict that stands for a rank: ``live`` (judged now), or, between the budget and the KV cache's
    allocation, the budget-time verdict where it is worse (it is the one that knows where the cache will go), with
    the live verdict's :data:`RANK_REASONS` it does not hold (a newer probe's unknown fields, a stale snapshot,
    out-of-memory errors climbing): what it stands for the rank must not hide what the rank says now."""
    if at_budget is None or kv_cache_exists or at_budget.severity <= live.severity:
        return live
    held = {r.code for r in at_budget.reasons}
    kept = [r for r in live.reasons if r.code in RANK_REASONS and r.code not in held]
    if not kept:
        return at_budget
    reasons = tuple(sorted((*at_budget.reasons, *kept), key=lambda r: -SEVERITY[r.state]))
    return replace(at_budget, reasons=reasons, state=_worst_state(r.state for r in reasons))


def worst(verdicts: list[Verdict]) -> str:
    """The overall state of the ranks judged; ``warning`` when there are none: no verdict is no all-clear."""
    if not verdicts:
        return WARNING
    return _worst_state(v.state for v in verdicts)


def no_ranks_reason(why: str) -> Reason:
    """The overall reason when no rank was judged; ``why`` says what was looked at."""
    return Reason(NO_RANKS, f"no rank judged ({why}): the guard cannot say the KV cache fits")


class CounterWindow:
    """How much a monotonic counter grew over the last ``window_seconds``, per key.

    Pure: the caller passes the time. A counter that goes down (the process restarted)
    starts over from its new value.
    """

    MAX_SAMPLES = 512  # per key: a counter sampled more often than this keeps only the latest

    def __init__(self, window_seconds: float = 300.0):
        self.window_seconds = window_seconds
        self._samples: dict[Hashable, deque[tuple[float, int]]] = {}

    def observe(self, key: Hashable, now: float, value: int | None) -> int | None:
        if value is None:
            return None
        samples = self._samples.setdefault(key, deque(maxlen=self.MAX_SAMPLES))
        if samples and value < samples[-1][1]:
            samples.clear()
        samples.append((now, value))
        while len(samples) > 1 and samples[1][0] <= now - self.window_seconds:
            samples.popleft()
        return value - samples[0][1]

    def forget_except(self, keys: set) -> None:
        for key in list(self._samples):
            if key not in keys:
                del self._samples[key]
