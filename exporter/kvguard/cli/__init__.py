"""The ``kvguard`` command line: one click group, one module per command.

``options`` holds what the commands share; a command module imports no other command module.
"""

from __future__ import annotations

import sys

import click

from kvguard import __version__
from kvguard.cli import budget, check, exits, plan, probe, serve, simulate  # the command modules
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
    # Under every command: what a SIZE is where it takes one, and its exit codes (one statement of each).
    epilog = [SIZE_HELP] if any(isinstance(p.type, SizeType) for p in command.params) else []
    command.epilog = "\n\n".join(epilog + [exits.summary(command.name)])
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
