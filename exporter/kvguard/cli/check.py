"""``kvguard check``: the guard once, as an exit code (0 ok, 1 warning, 2 critical, 3 could not judge)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import click

from kvguard.cli import exits
from kvguard.cli.options import SIZE, read_startup_log_or_fail

# kvguard check's exit codes, as Nagios plugins use them: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (no verdict:
# nothing to judge by, and every error: a bad option, an unreadable log, a crash). kvguard.cli.exits holds the table.
EXIT_OK, EXIT_WARNING, EXIT_CRITICAL, EXIT_UNKNOWN = exits.OK, exits.WARNING, exits.CRITICAL, exits.UNKNOWN


# Reason codes that mean "could not judge", not "judged badly".
UNJUDGED_REASONS = ("no_profile", "no_ranks")


class CheckError(click.ClickException):
    """A one-line error that exits 3 (UNKNOWN: the check reached no verdict), not 1 or 2 (a verdict)."""

    exit_code = EXIT_UNKNOWN


@click.command()
@click.option(
    "--spool-dir",
    envvar="KVGUARD_SPOOL_DIR",
    metavar="DIR",
    help="Spool of probe snapshots to judge [env KVGUARD_SPOOL_DIR].",
)
@click.option("--from-log", "log_file", metavar="FILE", help="vLLM startup log to take the profile from.")
@click.option("--vllm-metrics-url", metavar="URL", help="vLLM's /metrics, for num_gpu_blocks and KV usage.")
@click.option(
    "--stale-after",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    show_default=True,
    help="A snapshot older than this many seconds is stale.",
)
@click.option(
    "--forget-after",
    type=click.FloatRange(0, min_open=True),
    metavar="SECONDS",
    help="Leave out a rank whose snapshot was not written for this many seconds (a dead rank; "
    "one whose process is gone on this host goes at once) [default: 4 x --stale-after].",
)
@click.option(
    "--post-mortem",
    is_flag=True,
    help="Judge every rank as it was last written, however old and whether its process still runs "
    "(after a crash or a finished run); no rank ages out.",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(0, min_open=True),
    default=2.0,
    show_default=True,
    help="Time limit in seconds for each read.",
)
@click.option(
    "--total-memory",
    type=SIZE,
    help="With --from-log: the device memory vLLM saw, where the log does not state it (vllm-mindspore).",
)
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    help="With --from-log: vLLM's --gpu-memory-utilization, where the log does not state it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def check(
    spool_dir,
    log_file,
    vllm_metrics_url,
    stale_after,
    forget_after,
    post_mortem,
    read_timeout,
    total_memory,
    gpu_memory_utilization,
    as_json,
):
    """Run the guard once: exit 0 ok, 1 warning, 2 critical, 3 could not judge (as Nagios plugins do).

    For init containers and CI. Allocator retries and OOMs count since each process started.
    The state is /guard's. Exit 3 (UNKNOWN) when no verdict was reached: no rank to judge (an empty
    spool, a source down: no_ranks), a log without the figures its era's formula needs (no_profile),
    a bad option, an unreadable log or a crash; never 0. A --from-log log that states a refusal, a
    KV cache of zero or less, or an out-of-memory error is critical (2), with a post-mortem.
    """
    try:
        if post_mortem and forget_after is not None:
            raise CheckError("--post-mortem keeps every rank: it does not take --forget-after")
        _check(
            spool_dir,
            log_file,
            vllm_metrics_url,
            stale_after,
            read_timeout,
            as_json,
            total_memory,
            gpu_memory_utilization,
            forget_after,
            post_mortem,
        )
    except (
        click.exceptions.ClickException,
        click.exceptions.Exit,
        click.exceptions.Abort,
        SystemExit,
        KeyboardInterrupt,
    ):
        raise
    except Exception as exc:  # noqa: BLE001 - exit 1 means "warning" to the caller: a crash must say 2
        from kvguard.cli.options import stdout_closed
        from kvguard.text import one_line

        if isinstance(exc, BrokenPipeError) and stdout_closed():
            raise  # the reader went away: the group stops without a word (kvguard.cli.options.KVGuardGroup)

        raise CheckError(f"cannot judge: {one_line(exc, with_type=True)}") from None


def _check(
    spool_dir,
    log_file,
    vllm_metrics_url,
    stale_after,
    read_timeout,
    as_json,
    total_memory=None,
    gpu_memory_utilization=None,
    forget_after=None,
    post_mortem=False,
):
    from kvguard.sidecar.core import Sidecar, SidecarConfig
    from kvguard.sidecar.observation import SPOOL, VLLM_METRICS, aged_out_text
    from kvguard.units import format_gib

    if not (spool_dir or log_file or vllm_metrics_url):
        raise CheckError("nothing to check: give --spool-dir, --from-log or --vllm-metrics-url")
    if (total_memory is not None or gpu_memory_utilization is not None) and not log_file:
        raise CheckError("--total-memory and --gpu-memory-utilization complete a --from-log profile: give --from-log")
    startup = read_startup_log_or_fail(log_file, error=CheckError, oom_is_enough=True) if log_file else None
    if startup is not None and total_memory is not None:
        _refuse_a_device_smaller_than_the_log(startup, total_memory)
    findings = []
    if startup is not None:
        from kvguard.vllm.log_verdict import judge_log

        findings = judge_log(startup, total_memory, gpu_memory_utilization)

    sidecar = Sidecar(
        SidecarConfig(
            spool_dir=spool_dir,
            vllm_metrics_url=vllm_metrics_url,
            startup_log=startup,
            log_total_memory_bytes=total_memory,
            log_gpu_memory_utilization=gpu_memory_utilization,
            stale_after=stale_after,
            forget_after=forget_after,
            read_timeout=read_timeout,
            one_shot=True,
            post_mortem=post_mortem,
            pod_labels={"pod": "", "namespace": "", "container": ""},
        )
    )
    # A new sidecar's first observation waits for its reads (read_timeout); each source is read once.
    observation, rows = _judge_each_row(startup, sidecar) if startup is not None else (sidecar.observe(), [])
    shown = _shown_row(rows)
    if shown is not None:
        observation = shown.observation  # where the rows differ, the worst: never a false all-clear
    failed = {s.name: s.last_error for s in observation.sources if not s.up and s.last_error}
    if not observation.ranks:
        failed = {}  # the no_ranks reason names every source that is down
    if VLLM_METRICS in failed and vllm_metrics_url:
        click.echo(f"kvguard check: vLLM metrics: {failed[VLLM_METRICS]}", err=True)
    if SPOOL in failed:
        click.echo(f"kvguard check: spool: {failed[SPOOL]}", err=True)

    state = "critical" if findings else observation.state
    code = _exit_code(state, observation)
    if code == EXIT_UNKNOWN:
        state = "unknown"  # the JSON says what the exit code says: no verdict, not a warning
    if as_json:
        data = observation.guard_dict()
        data["state"] = state
        for rank in data.get("ranks", []):
            if rank.get("reasons") and all(r.get("code") in UNJUDGED_REASONS for r in rank["reasons"]):
                rank["state"] = "unknown"
        if startup is not None:
            data["log"] = {**_log_dict(startup, findings), **_rows_dict(rows, shown)}
        click.echo(json.dumps(data, indent=2))
    else:
        if startup is not None:
            click.echo(f"{'LOG':<8} {startup.era or startup.project}: {startup.era_reason}")
        for finding in findings:
            click.echo(f"{finding.state.upper():<8} log {finding.code}: {finding.message}")
        if len(rows) > 1:
            click.echo(f"{'ERAS':<8} {_rows_text(rows, shown)}")
            for row in rows:
                click.echo(f"         - {row.line()}")
        for reason in observation.reasons:
            # No rank judged: the same overall warning /guard and /readyz give (no false all-clear).
            click.echo(f"{_state_word(observation.state, [reason]):<8} {reason.code}: {reason.message}")
        for view in observation.ranks:
            verdict = view.verdict
            who = f"rank {view.labels['rank'] or '-'} {view.labels['device'] or '(from log)'}"
            if len(rows) > 1 and shown is not None and view.profile_origin != "snapshot":
                who += f" as {shown.era.name} budgets it"
            headroom = "" if verdict.headroom_bytes is None else f"  headroom {format_gib(verdict.headroom_bytes)}"
            phase = "  (budget-time verdict: the KV cache is not allocated yet)" if verdict.phase == "budget" else ""
            click.echo(f"{_state_word(verdict.state, verdict.reasons):<8} {who}{headroom}{phase}")
            for reason in verdict.reasons:
                click.echo(f"         - {reason.code}: {reason.message}")
            if verdict.reserved_peak_note:
                click.echo(f"         reserved peak: {verdict.reserved_peak_note}")
        if observation.aged_out and observation.ranks:  # with no rank, the no_ranks reason says it
            click.echo(f"({aged_out_text(observation.aged_out)})")
        skipped = sum(observation.skipped.values())
        if skipped:
            click.echo(
                f"({skipped} spool file(s) skipped: "
                f"{', '.join(f'{k} {v}' for k, v in sorted(observation.skipped.items()) if v)})"
            )
    sys.exit(code)


def _state_word(state: str, reasons) -> str:
    """WARNING, or UNKNOWN where every reason says the guard could not judge (as the exit code 3 says)."""
    if state == "warning" and reasons and all(r.code in UNJUDGED_REASONS for r in reasons):
        return "UNKNOWN"
    return state.upper()


def _exit_code(state: str, observation) -> int:
    """0 ok, 1 warning, 2 critical; 3 when every warning says the guard could not judge (no profile, no rank)."""
    if state == "critical":
        return EXIT_CRITICAL
    if state == "ok":
        return EXIT_OK
    reasons = list(observation.reasons) + [
        r for view in observation.ranks for r in view.verdict.reasons if r.state != "ok"
    ]
    if reasons and all(r.code in UNJUDGED_REASONS for r in reasons):
        return EXIT_UNKNOWN
    return EXIT_WARNING


def _log_dict(startup, findings) -> dict[str, Any]:
    block_size, block_source = startup.effective_block_size()
    return {
        "project": startup.project,
        "era": startup.era,
        "era_candidates": list(startup.era_candidates),
        "era_reason": startup.era_reason,
        "block_size": block_size,
        "block_size_source": block_source,
        "refusal": startup.refusal,
        "kv_cache_bytes": startup.available_kv_cache_bytes,
        "ooms": [o.to_dict() for o in startup.ooms],
        "findings": [f.to_dict() for f in findings],
        "figures": _figures(startup),
    }


def _figures(startup) -> dict[str, Any]:
    """Every figure the log states, as the reader read it (bytes, tokens, ratios): what the corpus tests score."""
    read = startup.to_dict()
    return {
        name: value
        for name, value in read.items()
        if name not in ("era", "era_candidates", "era_reason", "project", "ooms") and value is not None
    }


def _refuse_a_device_smaller_than_the_log(startup, total_memory: int) -> None:
    """``--total-memory 64`` (the unit forgotten) is 64 bytes: refuse it in one line, as ``budget`` refuses a
    figure larger than the device, rather than judge a device smaller than the weights it holds."""
    from kvguard.budget.fields import field as profile_field
    from kvguard.units import format_bytes, format_gib

    stated = [
        (name, getattr(startup, field))
        for name, field in (
            (profile_field("weights_bytes").word, "weights_bytes"),
            ("KV cache", "available_kv_cache_bytes"),
            ("requested memory", "requested_memory_bytes"),
        )
    ]
    larger = [(name, value) for name, value in stated if value is not None and value > total_memory]
    if larger:
        name, value = larger[0]
        raise CheckError(
            f"--total-memory {format_bytes(total_memory)} is less than the log's {name} "
            f"({format_gib(value)}): check its unit"
        )


# ------------------------------------------------------------- --from-log: a verdict per era row the log leaves

_STATE_ORDER = {"ok": 0, "unknown": 1, "warning": 2, "critical": 3}  # the worst wins; unknown is no all-clear
_EXIT_STATE = {EXIT_OK: "ok", EXIT_WARNING: "warning", EXIT_CRITICAL: "critical", EXIT_UNKNOWN: "unknown"}


@dataclass(frozen=True)
class _RowVerdict:
    """The guard's verdict on the log judged as one of the era rows its lines leave."""

    era: Any  # kvguard.vllm.eras.Era
    observation: Any  # kvguard.sidecar.observation.Observation
    state: str  # ok, warning, critical, unknown (as the exit code would say it)
    view: Any  # the rank the row's formula judged (the log's), or None

    def figures(self) -> dict[str, Any]:
        verdict = self.view.verdict if self.view is not None else None
        profile = self.view.profile if self.view is not None else None
        return {
            "era": self.era.name,
            "formula": self.era.formula,
            "state": self.state,
            "kv_budget_bytes": verdict.stock_budget_bytes if verdict else None,
            "kv_cache_bytes": verdict.kv_cache_bytes if verdict else None,
            "headroom_bytes": verdict.headroom_bytes if verdict else None,
            "reasons": [r.to_dict() for r in verdict.reasons]
            if verdict
            else [r.to_dict() for r in self.observation.reasons],
            "profile": profile.to_dict() if profile is not None else None,
        }

    def line(self) -> str:
        from kvguard.units import format_gib

        figures = self.figures()
        parts = [f"{self.era.name} ({self.era.formula}): {self.state}"]
        if figures["kv_budget_bytes"] is not None:
            parts.append(f"KV budget {format_gib(figures['kv_budget_bytes'])}")
        if figures["headroom_bytes"] is not None:
            parts.append(f"headroom {format_gib(figures['headroom_bytes'])}")
        codes = [r["code"] for r in figures["reasons"]]
        return ", ".join(parts) + (f" ({', '.join(codes)})" if codes else "")


def _judge_each_row(startup, sidecar) -> tuple[Any, list[_RowVerdict]]:
    """The log's own observation, and the guard's verdict under each era row the log leaves (one where its lines
    pin the row, none where they leave none). The log is judged as each row in turn (kvguard.vllm.log_profile.
    as_row), never pinned to one. The sidecar reads a log's row through its formula alone (log_profile), so rows
    that share a formula share one observation (the log's own too, where its formula is a row's), and the rows
    are judged on one read of every source at one moment (Sidecar.observe_as); ranks whose profile is their own
    snapshot's do not depend on the log's row at all."""
    from kvguard.vllm.log_profile import as_row, candidate_rows

    candidates = candidate_rows(startup)
    own_formula = startup.profile_fields()["formula"]
    as_rows: dict[str, Any] = {}
    if len(candidates) > 1:
        for row in candidates:
            if row.formula != own_formula:
                as_rows.setdefault(row.formula, as_row(startup, row))
    observation, *judged_as = sidecar.observe_as([startup, *as_rows.values()])
    on_log = any(view.profile_origin != "snapshot" for view in observation.ranks)
    by_formula: dict[str, Any] = {own_formula: observation, **dict(zip(as_rows, judged_as))}
    rows = []
    for row in candidates:
        judged = by_formula[row.formula] if len(candidates) > 1 and on_log else observation
        state = _EXIT_STATE[_exit_code(judged.state, judged)]
        view = next((v for v in judged.ranks if v.profile_origin != "snapshot"), None)
        rows.append(_RowVerdict(row, judged, state, view))
    return observation, rows


def _shown_row(rows: list[_RowVerdict]) -> _RowVerdict | None:
    """The row whose verdict stands for the log: the worst state, and of those the least headroom."""
    if not rows:
        return None

    def badness(row: _RowVerdict):
        headroom = row.view.verdict.headroom_bytes if row.view is not None else None
        return (_STATE_ORDER[row.state], 0 if headroom is None else -headroom)

    return max(rows, key=badness)  # max keeps the first (in the table's order) of equals


def _holds_on_all(rows: list[_RowVerdict]) -> bool:
    return len({row.state for row in rows}) == 1


def _rows_text(rows: list[_RowVerdict], shown: _RowVerdict) -> str:
    """One line: the verdict holds on all the rows, or the rows it differs on and that the worst stands."""
    names = ", ".join(row.era.name for row in rows)
    if _holds_on_all(rows):
        own = (
            " (every rank is judged on its own snapshot's profile, not the log's)"
            if shown.observation.ranks and all(row.view is None for row in rows)
            else ""
        )
        return f"the verdict holds on all {len(rows)} rows the log's lines leave ({names}): {shown.state}{own}"
    states = sorted({row.state for row in rows}, key=lambda s: -_STATE_ORDER[s])
    groups = "; ".join(f"{state} on {', '.join(r.era.name for r in rows if r.state == state)}" for state in states)
    return (
        f"the verdict differs between the {len(rows)} rows the log's lines leave: {groups}; the worst, "
        f"{shown.state} ({shown.era.name}), stands: the lines cannot tell which row ran, and a better "
        f"verdict on another row is no all-clear"
    )


def _rows_dict(rows: list[_RowVerdict], shown: _RowVerdict | None) -> dict[str, Any]:
    """The JSON's per-row verdicts (docs/reference/json-output.md)."""
    if not rows:
        verdict = None
    elif len(rows) == 1:
        verdict = "pinned"
    else:
        verdict = "holds_on_all" if _holds_on_all(rows) else "differs"
    return {
        "era_verdict": verdict,
        "era_verdict_reason": _rows_text(rows, shown) if len(rows) > 1 and shown is not None else None,
        "era_shown": shown.era.name if shown is not None else None,
        "era_verdicts": [row.figures() for row in rows],
    }
