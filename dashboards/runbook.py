#!/usr/bin/env python3
"""Write kvguard's runbook from its one source, with the thresholds of the rules it ships with.

    python dashboards/runbook.py            write the three copies below
    python dashboards/runbook.py --check    exit 1 if a committed copy differs from what this writes

dashboards/runbook.template.md holds the text, one section per alert, with the rules' own placeholders:
${thresholds.NAME} (dashboards/rules.py DEFAULTS["thresholds"], written as rules.py writes them in the
expressions) and ${for.ALERT} (the alert's `for`). Three copies come from it:
  exporter/kvguard/runbook.md         the defaults filled: packaged, served by every sidecar at /runbook;
  docs/runbook.md                     the same text as a page of the docs (links made relative to docs/);
  helm/kvguard/files/runbook.template.md
                                      the placeholders kept: the chart fills them from .Values.prometheusRule
                                      (templates/runbook.yaml), so the pages it serves say what its rules do.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import rules  # noqa: E402  (dashboards/rules.py: the rules' config and how it writes numbers)

TEMPLATE = os.path.join(HERE, "runbook.template.md")
PACKAGED = os.path.join(ROOT, "exporter", "kvguard", "runbook.md")
DOCS = os.path.join(ROOT, "docs", "runbook.md")
CHART = os.path.join(ROOT, "helm", "kvguard", "files", "runbook.template.md")
PLACEHOLDER = re.compile(r"\$\{(thresholds|for)\.([A-Za-z0-9]+)\}")
DOCS_LEAD = ("<!-- Written by dashboards/runbook.py from dashboards/runbook.template.md: edit that. -->\n")


def fill(text: str, config: dict | None = None) -> str:
    """The template with config's thresholds and `for` durations (rules.merge: DEFAULTS under config)."""
    merged = rules.merge(config)

    def value(match: re.Match) -> str:
        kind, name = match.groups()
        table = merged["thresholds"] if kind == "thresholds" else merged["for"]
        if name not in table:
            raise KeyError(f"{match.group(0)}: no {kind} named {name} in dashboards/rules.py")
        return rules.number(table[name]) if kind == "thresholds" else str(table[name])

    filled = PLACEHOLDER.sub(value, text)
    if "${" in filled:
        raise ValueError(f"a placeholder this does not fill: {re.search(r'[$][{][^}]*[}]', filled).group(0)}")
    return filled


def for_docs(text: str) -> str:
    """The packaged copy's links (relative to exporter/kvguard/) made relative to docs/."""
    text = text.replace("](../../docs/", "](").replace("](../../", "](../")
    title, rest = text.split("\n", 1)
    return f"{title}\n\n{DOCS_LEAD.rstrip()}\n{rest}"


def outputs() -> dict[str, str]:
    with open(TEMPLATE, encoding="utf-8") as handle:
        template = handle.read()
    packaged = fill(template)
    return {PACKAGED: packaged, DOCS: for_docs(packaged), CHART: template}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed copies instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            try:
                with open(path, encoding="utf-8") as handle:
                    if handle.read() != text:
                        stale.append(path)
            except FileNotFoundError:
                stale.append(path)
        else:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
    for path in stale:
        print(f"{os.path.relpath(path, ROOT)} differs from what dashboards/runbook.py writes: run it", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
