"""What the commands share: option types (sizes in bytes, finite floats), the group that keeps every error to one line, JSON output, and reading a startup log or an era."""

from __future__ import annotations

import json
import math
import os
from typing import Any
import click
from kvguard.units import parse_size


class SizeType(click.ParamType):
    """SIZE: bytes, or a number with a unit (37.85GiB, 512MiB, 64GB)."""

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
    """The kvguard group: an exception no command turned into a one-line error is still one line
    (``KVGUARD_DEBUG=1`` re-raises it, traceback and all)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001
            if os.environ.get("KVGUARD_DEBUG"):
                raise
            from kvguard.text import one_line

            error = click.ClickException(f"internal error: {one_line(exc, with_type=True)}"
                                         " (KVGUARD_DEBUG=1 shows the traceback)")
            error.exit_code = 2
            raise error from None


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
        if block_size is None or (rule == "equal" and block_size != forced) \
                or (rule == "multiple" and block_size % forced):
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
