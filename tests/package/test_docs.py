"""The docs: generated reference pages equal the code, the README stays a front door, and every
relative link (with its anchor) lands somewhere."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest
from conftest import ROOT

README_LIMIT_BYTES = 15 * 1000  # issue 22: "a README of at most 15 KB"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", os.path.join(ROOT, "docs", "gen_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


def _markdown_files() -> list[str]:
    files = [
        os.path.join(ROOT, "README.md"),
        os.path.join(ROOT, "CHANGELOG.md"),
        os.path.join(ROOT, "bench", "results", "README.md"),
    ]
    files += glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    return sorted(f for f in files if os.path.exists(f))


# ----------------------------------------------------------------- generated reference pages


@pytest.mark.parametrize("page", sorted(GENERATOR.PAGES))
def test_the_generated_reference_page_is_what_the_code_makes_now(page):
    with open(os.path.join(ROOT, "docs", "reference", page), encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == GENERATOR.PAGES[page](), (
        f"docs/reference/{page} has drifted from the code: run python docs/gen_reference.py"
    )


def test_the_era_page_has_a_column_for_every_era_field_that_fits_a_cell():
    import dataclasses

    from kvguard.vllm.eras import ERAS

    header = next(line for line in GENERATOR.eras_page().splitlines() if line.startswith("| `name`"))
    columns = set(re.findall(r"`(\w+)`", header))
    for field in dataclasses.fields(ERAS[0]):
        values = [getattr(era, field.name) for era in ERAS]
        if not any(GENERATOR.is_detail(v) for v in values):
            assert field.name in columns, field.name


def test_the_era_page_has_one_row_per_era_and_each_names_its_formula():
    from kvguard.vllm.eras import ERAS

    page = GENERATOR.eras_page()
    for era in ERAS:
        rows = [line for line in page.splitlines() if line.startswith(f"| {era.name} |")]
        assert len(rows) == 1, era.name
        assert f"| {era.formula} |" in rows[0]


def test_the_cli_page_lists_every_command_and_every_option_flag():
    import click

    from kvguard.cli import main

    page = GENERATOR.cli_page()
    for name, command in main.commands.items():
        section = page.split(f"## `kvguard {name}`", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for flag in param.opts + param.secondary_opts:
                    assert f"`{flag}`" in section, (name, flag)


@pytest.mark.parametrize("page,name", sorted(GENERATOR.SECTIONS), ids=lambda v: str(v))
def test_the_generated_section_is_what_the_code_makes_now(page, name):
    with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as handle:
        committed = handle.read()
    assert GENERATOR.section_text(committed, name) == GENERATOR.SECTIONS[(page, name)]().rstrip("\n") + "\n\n", (
        f"docs/{page} section {name} has drifted from the code: run python docs/gen_reference.py"
    )


def _docs_copy(tmp_path, monkeypatch):
    """Every generated file as the code makes it, under tmp_path as the generator's docs/."""
    pages = GENERATOR.generated_pages()
    for page, text in pages.items():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(text, encoding="utf-8")
    monkeypatch.setattr(GENERATOR, "DOCS", str(tmp_path))
    monkeypatch.setattr(GENERATOR, "REFERENCE", str(tmp_path / "reference"))
    return pages


def test_the_check_mode_exits_1_on_a_page_that_differs(tmp_path, monkeypatch):
    _docs_copy(tmp_path, monkeypatch)
    assert GENERATOR.main(["--check"]) == 0
    (tmp_path / "reference" / "eras.md").write_text("stale\n", encoding="utf-8")
    assert GENERATOR.main(["--check"]) == 1
    assert (tmp_path / "reference" / "eras.md").read_text(encoding="utf-8") == "stale\n"  # --check writes nothing


@pytest.mark.parametrize("page,name", sorted(GENERATOR.SECTIONS), ids=lambda v: str(v))
def test_the_check_mode_exits_1_on_a_stale_section_and_the_write_mode_keeps_the_prose(
    tmp_path, monkeypatch, page, name
):
    pages = _docs_copy(tmp_path, monkeypatch)
    path = tmp_path / page
    stale = GENERATOR.with_section(pages[page], name, "| `kvguard_gone` | gauge | — | — | old |")
    path.write_text(stale, encoding="utf-8")
    assert GENERATOR.main(["--check"]) == 1
    assert path.read_text(encoding="utf-8") == stale
    assert GENERATOR.main([]) == 0
    assert path.read_text(encoding="utf-8") == pages[page]  # the section back, the prose around it untouched


def test_a_page_without_its_section_markers_fails_the_check(tmp_path, monkeypatch):
    pages = _docs_copy(tmp_path, monkeypatch)
    start = GENERATOR.section_start("metrics")
    (tmp_path / "metrics.md").write_text(pages["metrics.md"].replace(start, ""), encoding="utf-8")
    assert GENERATOR.main(["--check"]) == 1
    assert GENERATOR.main([]) == 1  # nowhere to write it: the page keeps what it has
    with pytest.raises(ValueError, match="metrics"):
        GENERATOR.with_section("# a page\n", "metrics", "body")


def test_a_changed_help_string_in_the_collector_fails_the_check(tmp_path, monkeypatch):
    from kvguard.sidecar import collector

    _docs_copy(tmp_path, monkeypatch)
    kind, name, _, labels, samples = collector._RANK_FAMILIES[0]
    monkeypatch.setattr(
        collector, "_RANK_FAMILIES", ((kind, name, "A new meaning.", labels, samples),) + collector._RANK_FAMILIES[1:]
    )
    assert GENERATOR.main(["--check"]) == 1
    assert GENERATOR.main([]) == 0
    row = next(
        line
        for line in (tmp_path / "metrics.md").read_text(encoding="utf-8").splitlines()
        if line.startswith(f"| `{name}` |")
    )
    assert row.endswith("| A new meaning. |")


def test_the_metrics_page_has_a_row_for_every_family_the_collector_declares():
    from monitoring import documented_metrics

    with open(os.path.join(ROOT, "exporter", "kvguard", "sidecar", "collector.py"), encoding="utf-8") as handle:
        declared = set(re.findall(r'"(kvguard_[a-z0-9_]+)",', handle.read()))
    assert len(declared) > 30
    assert documented_metrics() == declared  # the rules' and dashboards' contract is the collector's set
    rows = [line for line in GENERATOR.metrics_section().splitlines() if line.startswith("| `kvguard_")]
    assert len(rows) == len(declared)


def test_the_metrics_rows_say_type_labels_and_unit_as_the_collector_serves_them():
    section = GENERATOR.metrics_section()
    row = {
        line.split(" | ")[0][3:-1]: line.split(" | ") for line in section.splitlines() if line.startswith("| `kvguard_")
    }
    assert row["kvguard_allocator_ooms_total"][1:4] == ["counter", "rank labels", "—"]
    assert row["kvguard_kv_cache_budget_bytes"][1:4] == ["gauge", "rank labels, `budget`", "bytes"]
    assert row["kvguard_device_process_used_bytes"][1:4] == ["gauge", "device labels, `pid`", "bytes"]
    assert row["kvguard_source_up"][1:4] == ["gauge", "`source`", "—"]
    assert row["kvguard_spool_snapshots"][1:4] == ["gauge", "—", "—"]
    assert "| `state` | `kvguard_guard_state` | `ok`, `warning`, `critical` |" in section
    assert "`budget` | `kvguard_kv_cache_budget_bytes` | `stock`, `reserved` |" in section


def test_json_keys_are_listed_one_level_down_with_their_types():
    data = {
        "a": 1,
        "b": {"c": 1.5, "d": None},
        "e": [{"f": "x"}, {"g": True}],
        "h": [],
        "i": ["x"],
        "j": {str(n): n for n in range(GENERATOR.MAX_LISTED_KEYS + 1)},
    }
    assert GENERATOR.key_types(data) == {
        "a": "integer",
        "b": "object",
        "b.c": "number",
        "b.d": "null",
        "e": "array of object",
        "e[].f": "string",
        "e[].g": "boolean",
        "h": "array",
        "i": "array of string",
        "j": "object",
        "j.*": f"{GENERATOR.MAX_LISTED_KEYS + 1} keys, integer",
    }


def test_the_json_tables_mark_a_key_one_run_did_not_print():
    lines = GENERATOR.key_table([("small", {"x": 1}), ("large", {"x": 1, "y": {"z": "s"}})])
    assert lines[2:] == ["| `x` | integer | integer |", "| `y` | — | object |", "| `y.z` | — | string |"]


def _named_keys(section: str) -> set[str]:
    """The keys the first column of a hand-written "| Key | When | Meaning |" table names."""
    table = section.split("| Key | When | Meaning |", 1)[1].split("\n\n", 1)[0]
    return {key for line in table.splitlines()[2:] for key in re.findall(r"`([a-z_.]+)`", line.split(" | ")[0])}


def test_the_budget_json_meanings_name_every_top_level_key_the_command_prints():
    with open(os.path.join(ROOT, "docs", "reference", "json-output.md"), encoding="utf-8") as handle:
        page = handle.read()
    named = {key.split(".")[0] for key in _named_keys(page.split("## `kvguard budget --json`", 1)[1])}
    printed = set(re.findall(r"^\| `([a-z_]+)` \|", GENERATOR.budget_json_section(), re.MULTILINE))
    assert printed == named


def test_the_json_sections_show_no_local_path_or_temporary_spool():
    text = "".join(GENERATOR.SECTIONS[key]() for key in GENERATOR.SECTIONS if key[0].endswith("json-output.md"))
    assert ROOT not in text and "kvguard-gen-" not in text and "/tmp" not in text


# ----------------------------------------------------------------- the README


def test_the_readme_is_at_most_15_kb():
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= README_LIMIT_BYTES


def test_the_readme_keeps_the_sections_the_chart_and_the_tests_point_at():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    install = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "docker build -t" in install and "--set image.repository=" in install
    assert "./dev.sh run" in readme and "./dev.sh test" in readme


# ----------------------------------------------------------------- links

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to -."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as handle:
        text = FENCE.sub("", handle.read())
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return found


def test_github_slugs_are_made_as_github_makes_them():
    assert github_slug("`kvguard simulate --json`") == "kvguard-simulate---json"
    assert github_slug("What `./dev.sh test` sets up") == "what-devsh-test-sets-up"
    assert github_slug("2. Turn the plugin on") == "2-turn-the-plugin-on"
    assert github_slug("The demo's cost") == "the-demos-cost"


def relative_links(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        text = FENCE.sub("", handle.read())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [
        target for target in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)
    ]  # http:, https:, mailto:


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves_to_a_file_and_its_anchor(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(resolved):
            broken.append(f"{target}: no such file")
            continue
        if anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{os.path.relpath(path, ROOT)}: " + "; ".join(broken)


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title\n\n## A section\n\n[ok](b.md#the-end) [bad](b.md#nowhere) "
        "[gone](c.md) `[code](x.md)`\n\n```\n[fenced](y.md)\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("# The end\n", encoding="utf-8")
    links = relative_links(str(tmp_path / "a.md"))
    assert links == ["b.md#the-end", "b.md#nowhere", "c.md"]
    assert anchors(str(tmp_path / "b.md")) == {"the-end"}
