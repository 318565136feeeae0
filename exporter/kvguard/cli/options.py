"""What the commands share: option types (sizes in bytes, finite floats), the group that keeps every error to
one line, JSON output, and reading a startup log or an era."""

from __future__ import annotations

import json
import math
import os
import select
import sys
from typing import Any

import click

from kvguard.cli import exits
from kvguard.units import parse_size


class SizeType(click.ParamType):
    """SIZE: a number with a unit (37.85GiB, 512MiB, 64GB); kvguard.units.SIZE_HELP says which."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class SignedSizeType(SizeType):
    """A SIZE that may be negative (vLLM's non-torch increase can be)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, str) and value.strip().startswith("-"):
            return -super().convert(value.strip()[1:], param, ctx)
        return super().convert(value, param, ctx)


SIZE = SizeType()


SIGNED_SIZE = SignedSizeType()


class BytesOrSizeType(SizeType):
    """A flag named in bytes, as vLLM's --kv-cache-memory-bytes: a bare integer is bytes (the name says so),
    and a SIZE is taken too. What kvguard recommends as ``--kv-cache-memory-bytes N`` it takes back."""

    name = "BYTES|SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
        return super().convert(value, param, ctx)


BYTES_OR_SIZE = BytesOrSizeType()


class TokensType(click.ParamType):
    """A token count as vLLM's --max-model-len takes it: 32768, 32k (32,000) or 32K (32,768)."""

    name = "TOKENS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip().replace("_", "").replace(",", "")
            factor = 1000 if text.endswith("k") else 1024 if text.endswith("K") else 1
            digits = text[:-1] if factor > 1 else text
            try:
                number = int(float(digits) * factor) if factor > 1 else int(digits)
            except ValueError:
                self.fail(
                    f"{value!r} is not a token count (32768, 32k = 32,000 or 32K = 32,768, as vLLM reads "
                    f"--max-model-len)",
                    param,
                    ctx,
                )
        if number < 1:
            self.fail(f"{value!r} must be at least 1 token", param, ctx)
        return number


TOKENS = TokensType()


def renamed_option(old: str, dest: str, new: str, **attrs: Any):
    """An old flag name kept as a hidden alias of ``new``: its value fills ``dest`` (as typed on the command
    line), and using it warns on stderr."""

    def take(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None:
            return
        click.echo(f"kvguard: {old} is now {new}; {old} will go in a later release", err=True)
        if ctx.get_parameter_source(dest) == click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"{old} is {new}'s old name: give one of them")
        ctx.params[dest] = value
        ctx.set_parameter_source(dest, click.core.ParameterSource.COMMANDLINE)

    return click.option(
        old, "renamed_" + old.strip("-").replace("-", "_"), hidden=True, expose_value=False, callback=take, **attrs
    )


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (which compare as in range or unbounded)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return number


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


class KVGuardGroup(click.Group):
    """The kvguard group: every error exits with the code of kvguard.cli.exits' table for its command, and an
    exception no command turned into a one-line error is still one line (``KVGUARD_DEBUG=1`` re-raises it,
    traceback and all)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.ClickException as error:  # kvguard's own options, a command it does not know
            error.exit_code = exits.error_code(error, None)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException as error:
            error.exit_code = exits.error_code(error, ctx.invoked_subcommand)
            raise
        except (click.exceptions.Abort, KeyboardInterrupt):  # Ctrl-C: click would say 1, a judge's WARNING
            click.echo("Aborted!", err=True)
            code = exits.UNKNOWN if ctx.invoked_subcommand in exits.NAGIOS_PLUGINS else exits.INTERRUPTED
            raise click.exceptions.Exit(code) from None
        except (click.exceptions.Exit, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, BrokenPipeError) and stdout_closed():
                # The reader went away (`| head`): nothing more to say, and nothing to say it to. Python's own
                # flush of stdout at exit would fail again ("Exception ignored"): it goes to /dev/null instead.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
                code = exits.UNKNOWN if ctx.invoked_subcommand in exits.NAGIOS_PLUGINS else exits.OUTPUT_CLOSED
                raise click.exceptions.Exit(code) from None
            if os.environ.get("KVGUARD_DEBUG"):
                raise
            from kvguard.text import one_line

            error = click.ClickException(
                f"internal error: {one_line(exc, with_type=True)} (KVGUARD_DEBUG=1 shows the traceback)"
            )
            error.exit_code = exits.SOFTWARE
            error.exit_code = exits.error_code(error, ctx.invoked_subcommand)
            raise error from None


def stdout_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone: poll(2) reports POLLERR on a pipe's write end
    once its read end is closed (pipe(7)), whatever was written before."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def read_log(path: str):
    from kvguard.vllm.log import LogFileError, read_startup_log

    try:
        return read_startup_log(path)
    except LogFileError as exc:
        raise click.ClickException(str(exc)) from None


def era_for_release(release: str | None):
    if release is None:
        return None
    from kvguard.vllm.eras import EraError, era_for

    try:
        return era_for(release)
    except EraError as exc:
        raise click.UsageError(str(exc)) from None


def block_size_for(era, block_size: int | None, config: Any) -> int:
    """The era's default block size, and vLLM's MLA block size on CUDA where the era forces one."""
    from kvguard.budget.estimator import text_config

    is_mla = isinstance(config, dict) and "kv_lora_rank" in text_config(config)
    if era and is_mla and era.mla_block_size:
        forced, rule = era.mla_block_size, era.mla_block_rule
        if (
            block_size is None
            or (rule == "equal" and block_size != forced)
            or (rule == "multiple" and block_size % forced)
        ):
            return forced
        return block_size
    if block_size is not None:
        return block_size
    return era.default_block_size if era else 16


def read_startup_log_or_fail(path: str, error=click.ClickException, oom_is_enough: bool = False):
    """The log, and its profile checked here: a log stating an impossible profile (utilization 5.0) is
    refused in one line at startup, not at the first judgement."""
    from kvguard.budget.estimator import ProfileError
    from kvguard.vllm.log import LogFileError, read_startup_log

    try:
        startup = read_startup_log(path, oom_is_enough)
        startup.profile()
    except LogFileError as exc:
        raise error(str(exc)) from None
    except ProfileError as exc:
        raise error(f"--from-log {path}: the log's profile is impossible: {exc}") from None
    return startup


def format_count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
