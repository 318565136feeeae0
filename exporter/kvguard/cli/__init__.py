"""The ``kvguard`` command line: one click group, one module per command.

``options`` holds what the commands share; a command module imports no other command module.
"""

from __future__ import annotations

import sys

import click

from kvguard import __version__
from kvguard.cli import budget, check, plan, probe, serve, simulate   # the command modules
from kvguard.cli.options import KVGuardGroup, SizeType
from kvguard.units import SIZE_HELP


@click.group(cls=KVGuardGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvguard")
def main() -> None:
    """kvguard: allocator memory exporter and KV-cache OOM guard for LLM serving.

    Shows allocated versus reserved device memory for every rank, the KV-cache budget
    vLLM computed at startup beside the reserved-aware one, and warns before the OOM.
    """


for command in (budget.budget, plan.plan, simulate.simulate, probe.sample, probe.probe, serve.serve, check.check):
    if any(isinstance(p.type, SizeType) for p in command.params) and not command.epilog:
        command.epilog = SIZE_HELP   # one statement of what a SIZE is, under every command that takes one
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
