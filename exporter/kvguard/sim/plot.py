"""Plots of simulated runs (matplotlib, the optional ``plot`` extra); only the CLI imports this."""

from __future__ import annotations

from typing import Sequence

from ..units import gib
from .scenario import ScenarioResult
from .traces import ReplayResult


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'kvguard[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_scenario(results: Sequence[ScenarioResult], path: str, title: str | None = None) -> None:
    """Allocated and reserved memory per step (peaks within the step), device capacity,
    the vLLM budget line, the KV-cache band and the OOM point; one panel per result."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.6 * len(results)), squeeze=False,
                             sharex=True)  # one time axis: how long each run lasted is the story
    for ax, result in zip(axes[:, 0], results):
        timeline = result.timeline
        xs = list(range(len(timeline)))
        capacity = gib(result.device_total_bytes)
        ax.plot(xs, [gib(r.peak_allocated_bytes) for r in timeline], label="allocated (step peak)", color="tab:blue",
                lw=1.2)
        ax.plot(xs, [gib(r.peak_reserved_bytes) for r in timeline], label="reserved (step peak)", color="tab:orange",
                lw=1.2)
        ax.plot(xs, [gib(r.device_used_bytes) for r in timeline], label="device used", color="tab:gray", lw=0.8,
                ls=":")
        ax.axhline(capacity, color="black", lw=1, label="device capacity")
        if result.profile is not None:
            utilization = result.profile.gpu_memory_utilization
            ax.axhline(capacity * utilization, color="black", lw=0.8, ls="--",
                       label=f"capacity x {utilization:g}")
            if result.kv_cache_bytes and result.kv_cache_bytes > 0:
                base = gib(result.profile.weights_bytes)
                ax.axhspan(base, base + gib(result.kv_cache_bytes), color="tab:green", alpha=0.15,
                           label=f"KV cache ({result.config.budget} budget)")
        startup = sum(1 for r in timeline if r.phase != "serving")
        if startup and startup < len(timeline):
            ax.axvline(startup - 0.5, color="tab:gray", lw=0.6)
            ax.text(startup - 0.5, capacity * 0.03, " serving", fontsize=8, color="tab:gray")
        if result.oom and timeline:
            x = len(timeline) - 1
            y = gib(timeline[-1].peak_reserved_bytes)
            ax.plot([x], [y], marker="X", color="red", ms=11, ls="none",
                    label=f"OOM ({result.oom_phase}" + (f", step {result.oom_at_step})" if result.oom_at_step is not None
                                                         else ")"))
        cfg = result.config
        ax.set_title(title or f"{cfg.allocator}, budget {cfg.budget}, utilization {cfg.gpu_memory_utilization:g}, "
                     f"{gib(cfg.device_memory_bytes):g} GiB", fontsize=10)
        ax.set_ylabel("GiB")
        ax.set_xlabel("startup phases, then serving steps")
        ax.set_ylim(0, capacity * 1.05)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_replay(result: ReplayResult, capacity_bytes: int, path: str, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs = [s[0] for s in result.samples]
    ax.plot(xs, [gib(s[1]) for s in result.samples], label="allocated", color="tab:blue", lw=1)
    ax.plot(xs, [gib(s[2]) for s in result.samples], label="reserved", color="tab:orange", lw=1)
    ax.axhline(gib(capacity_bytes), color="black", lw=1, label="device capacity")
    if result.oom and result.samples:
        ax.plot([result.oom_at_event], [gib(result.samples[-1][2])], marker="X", color="red", ms=11, ls="none",
                label=f"OOM (event {result.oom_at_event})")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("trace event")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
