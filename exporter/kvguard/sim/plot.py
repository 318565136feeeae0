"""Plots of simulated runs (matplotlib, the optional ``plot`` extra); only the CLI imports this."""

from __future__ import annotations

from typing import Sequence

from kvguard.allocators.traces import ReplayResult
from kvguard.sim.scenario import ScenarioResult
from kvguard.units import gib


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        from kvguard.text import install_hint

        raise PlotUnavailable(f"--plot needs matplotlib: {install_hint('plot')}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_LABELS = {"weights": "weights", "profile": "profile", "kv_cache": "KV cache"}


def _phase_positions(timeline, spacing: float) -> list[float]:
    """x of each timeline point: serving step ``n`` at ``n``; the startup phases before 0, ``spacing``
    apart, so their labels have room however long serving lasted."""
    startup = sum(1 for r in timeline if r.phase != "serving")
    return [(i - startup) * spacing if i < startup else float(i - startup) for i in range(len(timeline))]


def _phase_ticks(timeline, positions: list[float]) -> tuple[list[float], list[str]]:
    """Ticks naming each startup phase, then serving steps at round numbers."""
    from matplotlib.ticker import MaxNLocator

    ticks = [(x, PHASE_LABELS.get(r.phase, r.phase)) for x, r in zip(positions, timeline) if r.phase != "serving"]
    serving = sum(1 for r in timeline if r.phase == "serving")
    if serving:
        for value in MaxNLocator(nbins=6, integer=True).tick_values(0, max(serving - 1, 1)):
            if 0 <= value <= serving - 1:
                ticks.append((float(value), f"{int(value)}"))
    return [x for x, _ in ticks], [label for _, label in ticks]


def scenario_figure(results: Sequence[ScenarioResult], title: str | None = None):
    """The figure ``plot_scenario`` saves: allocated and reserved memory per step (peaks within the
    step), device capacity, the vLLM budget line, the KV-cache band and the OOM point; one panel per
    result. The x-axis names the startup phases (weights, profile, KV cache), then counts serving steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(results), 1, figsize=(10, 3.6 * len(results)), squeeze=False, sharex=True
    )  # one time axis: how long each run lasted is the story
    longest = max(sum(1 for r in result.timeline if r.phase == "serving") for result in results)
    spacing = max(1.0, longest / 10)
    tick_source = max(results, key=lambda result: len(result.timeline))
    for ax, result in zip(axes[:, 0], results):
        timeline = result.timeline
        xs = _phase_positions(timeline, spacing)
        capacity = gib(result.device_total_bytes)
        ax.plot(
            xs,
            [gib(r.peak_allocated_bytes) for r in timeline],
            label="allocated (step peak)",
            color="tab:blue",
            lw=1.2,
            marker="." if len(timeline) < 50 else None,
        )
        ax.plot(
            xs, [gib(r.peak_reserved_bytes) for r in timeline], label="reserved (step peak)", color="tab:orange", lw=1.2
        )
        ax.plot(xs, [gib(r.device_used_bytes) for r in timeline], label="device used", color="tab:gray", lw=0.8, ls=":")
        ax.axhline(capacity, color="black", lw=1, label="device capacity")
        if result.profile is not None:
            utilization = result.profile.gpu_memory_utilization
            ax.axhline(capacity * utilization, color="black", lw=0.8, ls="--", label=f"capacity x {utilization:g}")
            if result.kv_cache_bytes and result.kv_cache_bytes > 0:
                base = gib(result.profile.weights_bytes)
                ax.axhspan(
                    base,
                    base + gib(result.kv_cache_bytes),
                    color="tab:green",
                    alpha=0.15,
                    label=f"KV cache ({result.config.budget} budget)",
                )
        startup = sum(1 for r in timeline if r.phase != "serving")
        if startup and startup < len(timeline):
            ax.axvline(-spacing / 2, color="tab:gray", lw=0.6)
            ax.text(-spacing / 2, capacity * 0.03, " serving", fontsize=8, color="tab:gray")
        if result.oom and timeline:
            x = xs[-1]
            y = gib(timeline[-1].peak_reserved_bytes)
            ax.plot(
                [x],
                [y],
                marker="X",
                color="red",
                ms=11,
                ls="none",
                label=f"OOM ({result.oom_phase}"
                + (f", step {result.oom_at_step})" if result.oom_at_step is not None else ")"),
            )
        cfg = result.config
        ax.set_title(
            title
            or f"{cfg.allocator}, budget {cfg.budget}, utilization {cfg.gpu_memory_utilization:g}, "
            f"{gib(cfg.device_memory_bytes):g} GiB",
            fontsize=10,
        )
        ax.set_ylabel("GiB")
        ax.set_ylim(0, capacity * 1.05)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
        ax.grid(alpha=0.3)
    bottom = axes[-1, 0]
    positions, labels = _phase_ticks(tick_source.timeline, _phase_positions(tick_source.timeline, spacing))
    bottom.set_xticks(positions, labels)
    bottom.set_xlabel("startup phase (weights, profile, KV cache), then serving step")
    fig.tight_layout()
    return fig


def plot_scenario(results: Sequence[ScenarioResult], path: str, title: str | None = None) -> None:
    """``scenario_figure`` written to ``path`` (PNG)."""
    plt = _pyplot()
    fig = scenario_figure(results, title)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_replay(result: ReplayResult, capacity_bytes: int, path: str, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs = [s[0] for s in result.samples]
    ax.plot(xs, [gib(s[1]) for s in result.samples], label="allocated", color="tab:blue", lw=1)
    ax.plot(xs, [gib(s[2]) for s in result.samples], label="reserved", color="tab:orange", lw=1)
    ax.axhline(gib(capacity_bytes), color="black", lw=1, label="device capacity")
    if result.oom and result.samples:
        ax.plot(
            [result.oom_at_event],
            [gib(result.samples[-1][2])],
            marker="X",
            color="red",
            ms=11,
            ls="none",
            label=f"OOM (event {result.oom_at_event})",
        )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("trace event")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
