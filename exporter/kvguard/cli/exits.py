"""Every command's exit codes, in one table (docs/reference/exit-codes.md and cli.md are generated from it).

0-3 are the states a judge returns, as Nagios plugins return them; plan and simulate --fail-on-oom say 2 for the
outcome they were asked to flag. An error is one of BSD sysexits.h's codes, the ones command-line tools share, so
a script tells a mistake in the command line (64) from input the command cannot use (65) and from a bug (70), and
none of them from a verdict. ``check`` is a Nagios plugin: Nagios Core reads a code above 3 as CRITICAL and puts
"(Return code of 64 ... was out of bounds)" in place of the plugin's line (base/checks.c,
get_service_check_return_code), while the plugin guidelines make a bad argument or an internal failure UNKNOWN; so
every error of check is 3.
"""

from __future__ import annotations

import dataclasses

import click

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
USAGE, DATAERR, SOFTWARE = 64, 65, 70  # sysexits.h: EX_USAGE, EX_DATAERR, EX_SOFTWARE
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C stopped (click's own 1 is WARNING)
OUTPUT_CLOSED = 141  # 128 + SIGPIPE, as a shell reports a command whose reader went away (`| head`)

# The commands that judge (1 and 3 are theirs), and those that are Nagios plugins (every error is UNKNOWN there).
JUDGES = ("check",)
NAGIOS_PLUGINS = ("check",)


@dataclasses.dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    word: str  # in a command's --help
    meaning: str


TABLE = (
    ExitCode(OK, "OK", "ok", "the command did its job; a judge: every rank ok"),
    ExitCode(WARNING, "WARNING", "warning", "a judge's warning"),
    ExitCode(
        CRITICAL,
        "CRITICAL",
        "critical",
        "the outcome the command was asked to flag: a critical verdict, a vLLM that would refuse to start, "
        "a run that ended in an out-of-memory error",
    ),
    ExitCode(UNKNOWN, "UNKNOWN", "unknown", "a judge could not judge (no rank, no profile); never 0"),
    ExitCode(
        USAGE,
        "EX_USAGE",
        "usage error",
        "a mistake in the command line: an unknown option or command, a missing or malformed value (a bare "
        "number for a SIZE), options that do not go together",
    ),
    ExitCode(
        DATAERR,
        "EX_DATAERR",
        "bad input",
        "input the command cannot use: a missing or malformed file, log, config, trace or profile, a figure "
        "out of range, a source or address that cannot be used",
    ),
    ExitCode(
        SOFTWARE,
        "EX_SOFTWARE",
        "internal error",
        "an internal error, in one line (KVGUARD_DEBUG=1 shows the traceback)",
    ),
    ExitCode(
        INTERRUPTED,
        "SIGINT",
        "interrupted",
        "stopped by Ctrl-C (SIGINT) before it finished: 128 + 2, as a shell reports it (serve and probe "
        "stop cleanly on it and say 0)",
    ),
    ExitCode(
        OUTPUT_CLOSED,
        "SIGPIPE",
        "output closed",
        "the reader of its output went away before it finished (`kvguard plan ... | head`): it stops writing, "
        "without a word, and says 128 + 13, as a shell reports a command that SIGPIPE stopped",
    ),
)
ERRORS = (USAGE, DATAERR, SOFTWARE, INTERRUPTED, OUTPUT_CLOSED)

# A command's own words for a code it gives for its own reason: a few for its --help, then in full for the docs.
OWN_WORDS = {
    "check": {UNKNOWN: "could not judge (every error too)"},
    "plan": {CRITICAL: "vLLM would refuse to start"},
    "simulate": {CRITICAL: "an OOM, with --fail-on-oom"},
}
OWN = {
    "check": {
        OK: "every rank judged ok",
        WARNING: "the worst state is warning",
        CRITICAL: "a rank is critical, or the --from-log log states a refusal, a KV cache of zero or less, or an "
        "out-of-memory error",
        UNKNOWN: "no verdict: no rank judged (no_ranks), a log without the figures its era's formula needs "
        "(no_profile); and every error (a bad option, an unreadable log, a crash), as a Nagios plugin "
        "returns it",
    },
    "plan": {
        OK: "vLLM would start (also when the verdict is critical or serving runs out of memory: the plan says so, "
        "will_fit false)",
        CRITICAL: "vLLM would refuse to start (the plan says why, will_start false)",
    },
    "simulate": {
        OK: "the run finished (one that ended in an OOM too, unless --fail-on-oom)",
        CRITICAL: "--fail-on-oom: the run ended in an out-of-memory error (oom true), or --search-utilization "
        "found no utilization that serves every seed without one",
    },
}


def codes_for(command: str) -> tuple[tuple[int, str], ...]:
    """(code, meaning) of every code ``kvguard COMMAND`` gives, in the table's order."""
    own = OWN.get(command, {})
    codes = []
    for row in TABLE:
        if row.code in (WARNING, UNKNOWN) and command not in JUDGES:
            continue
        if row.code == CRITICAL and CRITICAL not in own:
            continue
        if row.code in ERRORS and command in NAGIOS_PLUGINS:
            continue
        codes.append((row.code, own.get(row.code, row.meaning)))
    return tuple(codes)


def summary(command: str) -> str:
    """The codes of ``kvguard COMMAND`` in a few words, for its --help."""
    words = {row.code: OWN_WORDS.get(command, {}).get(row.code, row.word) for row in TABLE}
    return (
        "Exit codes: "
        + "; ".join(f"{code} {words[code]}" for code, _ in codes_for(command))
        + " (docs/reference/exit-codes.md)."
    )


def error_code(error: click.ClickException, command: str | None) -> int:
    """The table's code for an error ``kvguard COMMAND`` stops on: click gives 2 for a usage error and 1 for the
    rest, which a judge's caller reads as a verdict."""
    if command in NAGIOS_PLUGINS:
        return UNKNOWN
    if isinstance(error, click.UsageError) or error.exit_code == USAGE:
        return USAGE
    if error.exit_code == SOFTWARE:
        return SOFTWARE
    return DATAERR


class FlagsError(click.ClickException):
    """Options that do not go together: a usage error (64) in one line, without click's usage lines."""

    exit_code = USAGE
