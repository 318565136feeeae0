"""``kvguard sample`` and ``kvguard probe``: read a counter source once, or run the probe as its own process."""

from __future__ import annotations

from typing import Any

import click

from kvguard.cli.exits import FlagsError
from kvguard.cli.options import FiniteFloatRange, emit_json
from kvguard.units import format_bytes


def _build_source(source_name: str, options: dict[str, Any]):
    from kvguard.sources import SourceError, get_source

    try:
        return get_source(source_name, **options)
    except SourceError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option(
    "--source",
    "source_name",
    default="auto",
    show_default=True,
    metavar="NAME",
    help="auto, host, mindspore, npu-smi, nvml, sim, torch.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def sample(source_name, as_json):
    """Read a source once and print one line per device (allocator split where the source has it)."""
    from kvguard.sources import SourceError, close_source

    source = _build_source(source_name, {})
    try:
        records = source.sample()
    except SourceError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        close_source(source)
    if as_json:
        emit_json({"source": source_name, "devices": [record.to_dict() for record in records]})
        return
    if not records:
        click.echo(f"{source_name}: no device to report")
        return
    click.echo(
        f"{'DEVICE':<10} {'SOURCE':<10} {'ALLOCATED':>11} {'RESERVED':>11} {'PEAK RES.':>11} "
        f"{'FRAG.':>11} {'USED':>11} {'TOTAL':>11} PROCESSES"
    )
    for r in records:
        processes = ", ".join(f"{p.pid}={format_bytes(p.used_bytes)}" for p in r.processes) or "-"
        click.echo(
            f"{r.device:<10} {r.source:<10} {format_bytes(r.allocated_bytes):>11} "
            f"{format_bytes(r.reserved_bytes):>11} {format_bytes(r.peak_reserved_bytes):>11} "
            f"{format_bytes(r.fragmentation_bytes):>11} {format_bytes(r.used_bytes):>11} "
            f"{format_bytes(r.total_bytes):>11} {processes}"
        )


@click.command()
@click.option(
    "--source",
    "source_name",
    default="auto",
    show_default=True,
    metavar="NAME",
    help="auto, host, mindspore, npu-smi, nvml, sim, torch.",
)
@click.option(
    "--spool-dir",
    required=True,
    envvar="KVGUARD_SPOOL_DIR",
    metavar="DIR",
    help="Where to write the snapshots [env KVGUARD_SPOOL_DIR].",
)
@click.option(
    "--interval",
    type=FiniteFloatRange(0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds between samples.",
)
@click.option("--once", is_flag=True, help="Sample and write once, then exit.")
@click.option("--ranks", type=click.IntRange(1, 64), help="Simulated ranks (--source sim).")
@click.option(
    "--steps-per-sample",
    type=click.IntRange(min=1),
    help="Scheduler steps each simulated rank takes per sample (--source sim).",
)
def probe(source_name, spool_dir, interval, once, ranks, steps_per_sample):
    """Run the probe as its own process: one snapshot per device in the spool, every --interval seconds."""
    from kvguard.probe import Probe, run_until_signalled

    options = {
        key: value for key, value in (("ranks", ranks), ("steps_per_sample", steps_per_sample)) if value is not None
    }
    if options and source_name != "sim":
        flag = "--ranks" if "ranks" in options else "--steps-per-sample"
        raise FlagsError(f"{flag} applies to --source sim only")
    source = _build_source(source_name, options)
    try:
        runner = Probe(spool_dir, source, interval)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if once:
        import logging

        logging.getLogger("kvguard.probe").setLevel(logging.ERROR)  # the one-line error below says it
        written = runner.run_once(timeout=max(interval, 30.0))
        runner.stop()
        if not written:
            raise click.ClickException(runner.status.last_error or f"{source_name}: no device to sample")
        click.echo(f"wrote {written} snapshot{'s' if written != 1 else ''} to {spool_dir}")
        return
    click.echo(f"kvguard probe: {source_name} every {interval:g}s into {spool_dir} (Ctrl-C to stop)", err=True)
    run_until_signalled(runner)
