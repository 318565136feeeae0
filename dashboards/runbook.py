#!/usr/bin/env python3
"""Write kvguard's runbook from its one source, with the thresholds of the rules it ships with.

    python dashboards/runbook.py            write the three copies below
    python dashboards/runbook.py --check    exit 1 if a committed copy differs from what this writes
    python dashboards/runbook.py --pages DIR [--config my.yaml]
                                            the runbook as static HTML pages for a site of your own

dashboards/runbook.template.md holds the text, one section per alert, with the rules' own placeholders:
${thresholds.NAME} (dashboards/rules.py DEFAULTS["thresholds"], written as rules.py writes them in the
expressions) and ${for.ALERT} (the alert's `for`). Three copies come from it:
  exporter/kvguard/runbook.md         the defaults filled: packaged, served by every sidecar at /runbook;
  docs/runbook.md                     the same text as a page of the docs (links made relative to docs/);
  helm/kvguard/files/runbook.template.md
                                      the placeholders kept: the chart fills them from .Values.prometheusRule
                                      (templates/runbook.yaml), so the pages it serves say what its rules do.

--pages writes, for rules without the chart, DIR/index.html (the whole runbook, each alert's heading with
the id <alertname in lower case>, so index.html#kvguardexporterdown opens its section) and one page per
alert, DIR/<alertname in lower case>.html (the chart's layout), with the thresholds of --config (shaped like
the chart's prometheusRule values, as rules.py --config takes it). Served anywhere that needs no scrape
credentials, index.html is the page the plain rule files link to once Prometheus has the external label
kvguard_runbook_url naming it (dashboards/rules.py RUNBOOK_URL).
"""

from __future__ import annotations

import argparse
import html
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
SECTION = re.compile(r"^## (\S+)$", flags=re.M)
DOCS_LEAD = "<!-- Written by dashboards/runbook.py from dashboards/runbook.template.md: edit that. -->\n"


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


def page(title: str, markdown: str, lead: str = "") -> str:
    """markdown as one HTML page: `## NAME` headings as <h2 id="name">, the text between them escaped in <pre>."""
    body, at = [], 0
    for match in SECTION.finditer(markdown):
        body.append(_pre(markdown[at : match.start()]))
        name = match.group(1)
        body.append(f'<h2 id="{html.escape(name.lower(), quote=True)}">{html.escape(name)}</h2>\n')
        at = match.end()
    body.append(_pre(markdown[at:]))
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
        "<style>pre { white-space: pre-wrap; font-family: inherit; }</style></head>\n<body>\n"
        f"{lead}{''.join(body)}</body>\n</html>\n"
    )


def _pre(text: str) -> str:
    text = text.strip("\n")
    return f"<pre>{html.escape(text)}</pre>\n" if text.strip() else ""


def pages(config: dict | None = None) -> dict[str, str]:
    """file name -> HTML: index.html (the whole runbook) and <alertname>.html per alert, filled from config."""
    with open(TEMPLATE, encoding="utf-8") as handle:
        text = fill(handle.read(), config)
    result = {"index.html": page("kvguard runbook", text)}
    starts = [m.start() for m in SECTION.finditer(text)] + [len(text)]
    for start, end in zip(starts, starts[1:]):
        name = SECTION.match(text, start).group(1)
        result[f"{name.lower()}.html"] = page(
            f"kvguard runbook: {name}", text[start:end], '<p><a href="index.html">The whole runbook</a></p>\n'
        )
    return result


def outputs() -> dict[str, str]:
    with open(TEMPLATE, encoding="utf-8") as handle:
        template = handle.read()
    packaged = fill(template)
    return {PACKAGED: packaged, DOCS: for_docs(packaged), CHART: template}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed copies instead of writing")
    parser.add_argument("--pages", metavar="DIR", help="write the runbook as static HTML pages into DIR instead")
    parser.add_argument("--config", help="with --pages: a YAML file shaped like the chart's prometheusRule values")
    args = parser.parse_args(argv)
    if args.config and not args.pages:
        parser.error("--config goes with --pages")
    if args.pages:
        try:
            written = pages(rules.load_config(args.config) if args.config else None)
        except (rules.ConfigError, KeyError, ValueError) as exc:
            print(f"runbook.py: {exc}", file=sys.stderr)
            return 2
        os.makedirs(args.pages, exist_ok=True)
        for name, text in written.items():
            with open(os.path.join(args.pages, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        return 0
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
