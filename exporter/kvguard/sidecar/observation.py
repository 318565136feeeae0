"""What the sidecar saw at one refresh: every rank with its verdict, every device, every source.

Plain records, rendered by the collector (/metrics), /guard, /readyz and `kvguard check` alike, so
they never disagree. Built by ``kvguard.sidecar.core.Sidecar``; nothing here reads or waits."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvguard.budget.estimator import Profile
from kvguard.guard.judge import Reason, Verdict, no_ranks_reason, worst
from kvguard.records import DeviceMemory
from kvguard.sidecar.poller import PollState
from kvguard.spool.schema import POD_ENV as SNAPSHOT_POD_ENV, Snapshot
from kvguard.text import safe_text

RANK_LABELS = ("device", "rank", "pid", "pod", "namespace", "container")
# The pod labels of a rank: the snapshot's pod identity but node, read from the same
# downward-API environment (container has no downward field: the chart sets it).
POD_KEYS = tuple(key for key in SNAPSHOT_POD_ENV if key != "node")
POD_ENV = {key: SNAPSHOT_POD_ENV[key] for key in POD_KEYS}
SPOOL = "spool"
ENGINE_ID_ENV = "KVGUARD_ENGINE_ID"
VLLM_METRICS = "vllm_metrics"
DUPLICATE = "duplicate"
# Why a rank was left out as dead (a label value, so the set is fixed).
PROCESS_EXITED = "process_exited"
NOT_WRITTEN = "not_written"
AGED_OUT_REASONS = (PROCESS_EXITED, NOT_WRITTEN)
# Why a rank was cut from what the sidecar exports (a label value, so the set is fixed): the caps that
# keep /metrics and the sidecar's memory bounded whatever the spool holds (SidecarConfig).
CUT_REASONS = ("max_ranks", "max_engines", "max_models", "max_pods", "max_bytes")


def pod_labels_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {key: safe_text(environ.get(var, ""), 253) for key, var in POD_ENV.items()}


@dataclass(frozen=True)
class RankView:
    labels: dict[str, str]
    snapshot: Snapshot | None
    profile: Profile | None
    profile_origin: str | None  # "snapshot" or "log"
    kv_cache_blocks: int | None
    kv_cache_usage_ratio: float | None
    age_seconds: float | None
    stale: bool
    verdict: Verdict
    at_budget: Verdict | None = None  # the probe's budget-time verdict, from before the KV cache existed

    def identity(self) -> dict[str, str]:
        """The identity labels the rank's series carry (collector.RANK_IDENTITY_LABELS); "" where unknown."""
        memory = self.snapshot.memory if self.snapshot else None
        return {
            "device_uuid": memory.device_uuid if memory else "",
            "pci_bus_id": memory.pci_bus_id if memory else "",
            "model_name": self.labels.get("model_name", ""),
            "engine": self.labels.get("engine", ""),
            "engine_id": self.labels.get("engine_id", ""),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: self.labels[k] for k in RANK_LABELS},
            **self.identity(),
            "host": self.snapshot.host if self.snapshot else None,
            "profile_origin": self.profile_origin,
            "snapshot_age_seconds": None if self.age_seconds is None else round(self.age_seconds, 3),
            "stale": self.stale,
            "kv_cache_blocks": self.kv_cache_blocks,
            "kv_cache_usage_ratio": self.kv_cache_usage_ratio,
            **self.verdict.to_dict(),
            "at_budget": None if self.at_budget is None else self.at_budget.to_dict(),
        }


@dataclass(frozen=True)
class DeviceView:
    labels: dict[str, str]  # device, source, pod, namespace, container
    memory: DeviceMemory


@dataclass(frozen=True)
class Observation:
    ranks: list[RankView]
    devices: list[DeviceView]
    sources: list[PollState]  # spool, each device source, vLLM
    spool_snapshots: int
    skipped: Counter
    interval_seconds: float
    spool_clamped: int = 0  # snapshots dated in the future at the last spool read
    no_ranks_why: str = "nothing to read"  # what was looked at, when no rank was judged
    aged_out: Counter = field(default_factory=Counter)  # AGED_OUT_REASONS -> ranks left out as dead
    cut: Counter = field(default_factory=Counter)  # CUT_REASONS -> ranks left out by a cap
    labels_truncated: int = 0  # label values cut to max_label_chars
    max_metrics_bytes: int | None = None  # the /metrics rank series stay within this
    # --web.config.file's reloads: (the last one applied, reloads by result); None without a web config
    web_config: tuple[bool, Mapping[tuple[str, str], int]] | None = None

    @property
    def state(self) -> str:
        """The worst rank's state; ``warning`` (reason ``no_ranks``) when no rank was judged."""
        return worst([r.verdict for r in self.ranks])

    @property
    def reasons(self) -> list[Reason]:
        """The overall reasons beside the ranks' own: ``no_ranks`` when there is no rank."""
        return [] if self.ranks else [no_ranks_reason(self.no_ranks_why)]

    def readiness(self, fail_on_critical: bool) -> tuple[int, str]:
        """/readyz: (status, body). The body states the same overall state as /guard; 503 only
        while a rank is critical and ``fail_on_critical`` is set (a warning never fails readiness)."""
        from kvguard.guard.judge import CRITICAL

        if fail_on_critical and self.state == CRITICAL:
            critical = [r for r in self.ranks if r.verdict.state == CRITICAL]
            lines = [
                f"critical: rank {r.labels['rank'] or '-'} device {r.labels['device'] or '-'}: "
                f"{'; '.join(reason.code for reason in r.verdict.reasons)}"
                for r in critical
            ]
            return 503, "\n".join(lines) + "\n"
        why = "".join(f"; {reason.code}: {reason.message}" for reason in self.reasons)
        return 200, f"ready\nguard: {self.state}{why}\n"

    def guard_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reasons": [r.to_dict() for r in self.reasons],
            "ranks": [r.to_dict() for r in self.ranks],
            "sources": {
                s.name: {"up": s.up, "errors_total": s.errors_total, "last_error": s.last_error} for s in self.sources
            },
            "spool": {
                "snapshots": self.spool_snapshots,
                "skipped": dict(self.skipped),
                "clamped_timestamps": self.spool_clamped,
                "aged_out": dict(self.aged_out),
                "cut": dict(self.cut),
                "labels_truncated": self.labels_truncated,
            },
        }


def aged_out_text(aged_out: Counter) -> str:
    """``N rank(s) aged out: process_exited M, not_written N``."""
    return f"{sum(aged_out.values())} rank(s) aged out: " + ", ".join(
        f"{reason} {aged_out[reason]}" for reason in AGED_OUT_REASONS if aged_out[reason]
    )
