"""One set of conventions for every command (issue 35): what a SIZE is, one name per quantity, old names kept
as aliases that warn, and every recommendation a flag the tool takes back."""

from __future__ import annotations

import json
import os
import re

import click
import pytest
from click.testing import CliRunner

from conftest import EXAMPLES
from kvguard.cli import main
from kvguard.cli.options import SizeType, TokensType
from kvguard.units import parse_size

QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")
SEED_PROFILE = os.path.join(EXAMPLES, "qwen2.5-7b-910b-profile.json")
GIB = 1 << 30

# Flags that name one quantity, as users have typed them or other tools spell them. Exactly one spelling of
# each may be a visible option of any command; the others are at most hidden aliases.
SYNONYMS = {
    "the device's total memory": ("--total-memory", "--device-memory", "--gpu-memory", "--device-capacity",
                                  "--total-gpu-memory", "--capacity"),
    "the KV cache memory": ("--kv-cache-memory-bytes", "--kv-cache-memory", "--kv-cache-bytes", "--kv-cache-size"),
    "tokens per request": ("--max-model-len", "--max-seq-len", "--max-model-length", "--context-length"),
    "the utilization": ("--gpu-memory-utilization", "--utilization", "--memory-utilization"),
    "memory outside the allocator": ("--non-allocator-memory", "--non-torch-allocator-memory"),
}


def visible_options():
    """(command, option) for every visible option of every command."""
    for name, command in main.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                yield name, param


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("quantity", sorted(SYNONYMS))
def test_one_quantity_has_one_visible_flag_across_commands(quantity):
    used = {(flag, name) for name, option in visible_options() for flag in option.opts if flag in SYNONYMS[quantity]}
    assert len({flag for flag, _ in used}) <= 1, sorted(used)


def unit(option) -> str:
    kind = option.type
    if isinstance(kind, (SizeType, TokensType)):
        return kind.name
    if isinstance(kind, (click.types.FloatParamType, click.FloatRange)):
        return "FLOAT"
    if isinstance(kind, (click.types.IntParamType, click.IntRange)):
        return "INTEGER"
    return type(kind).__name__


def test_a_flag_two_commands_share_has_one_unit():
    units: dict[str, set[str]] = {}
    for _, option in visible_options():
        for flag in option.opts:
            units.setdefault(flag, set()).add(unit(option))
    assert {flag: kinds for flag, kinds in units.items() if len(kinds) > 1} == {}


def size_options():
    return [(name, option.opts[0]) for name, option in visible_options()
            if isinstance(option.type, SizeType) and option.opts[0].startswith("--")]


def test_every_command_that_takes_a_size_states_what_a_size_is_in_its_help():
    commands = {name for name, _ in size_options()}
    assert {"budget", "check", "simulate", "plan"} <= commands
    for name in commands:
        text = " ".join(invoke(name, "--help").output.split())
        assert "64GB is 64,000,000,000 bytes (59.60 GiB)" in text and "64GiB is 68,719,476,736 bytes" in text, name


@pytest.mark.parametrize(("command", "flag"), size_options())
def test_a_bare_number_is_refused_by_every_size_option_with_the_units_listed(command, flag):
    result = invoke(command, flag, "64")
    assert result.exit_code != 0
    if "BYTES|SIZE" in invoke(command, "--help").output and flag == "--kv-cache-memory-bytes":
        return   # named in bytes: a bare number is bytes there (tested below)
    assert f"Invalid value for '{flag}': '64' has no unit" in result.output
    assert "KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024)" in result.output


@pytest.mark.parametrize(("text", "size"), [("64GB", 64_000_000_000), ("64GiB", 64 * GIB), ("64Gi", 64 * GIB),
                                            ("512MiB", 512 << 20), ("1.5TB", 1_500_000_000_000), ("0", 0),
                                            ("4096B", 4096)])
def test_a_size_is_a_number_with_an_si_or_iec_unit(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["64", "64G", "64g", "512M", "2T", "1k"])
def test_a_bare_number_and_a_one_letter_unit_are_refused(text):
    with pytest.raises(ValueError, match="no unit|ambiguous"):
        parse_size(text)


def test_the_device_s_total_memory_is_total_memory_in_simulate_and_its_old_name_warns():
    new = invoke("simulate", "--total-memory", "16GiB", "--requests", "2", "--json")
    old = invoke("simulate", "--device-memory", "16GiB", "--requests", "2", "--json")
    assert new.exit_code == old.exit_code == 0
    assert old.output.startswith("kvguard: --device-memory is now --total-memory")
    assert json.loads(old.output[old.output.index("{"):]) == json.loads(new.output)
    assert "--device-memory" not in invoke("simulate", "--help").output


def test_budget_takes_back_the_kv_cache_memory_bytes_it_recommends():
    result = invoke("budget", "--profile", SEED_PROFILE, "--model-config", QWEN, "--json")
    recommended = json.loads(result.output)["recommended_flags"]
    flag = next(f for f in recommended if f.startswith("--kv-cache-memory-bytes"))
    value = re.split(r"[ =]", flag)[1]
    again = invoke("budget", "--model-config", QWEN, "--kv-cache-memory-bytes", value, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["kv_cache_memory_bytes"] == int(value)


def test_budget_s_old_kv_cache_memory_name_warns_and_gives_the_same_blocks():
    new = invoke("budget", "--model-config", QWEN, "--kv-cache-memory-bytes", "37.85GiB", "--json")
    old = invoke("budget", "--model-config", QWEN, "--kv-cache-memory", "37.85GiB", "--json")
    assert old.output.startswith("kvguard: --kv-cache-memory is now --kv-cache-memory-bytes")
    assert json.loads(old.output[old.output.index("{"):])["num_blocks"] == json.loads(new.output)["num_blocks"]


@pytest.mark.parametrize(("text", "tokens"), [("32768", 32768), ("32k", 32_000), ("32K", 32_768)])
def test_max_model_len_reads_as_vllm_reads_it_in_every_command(text, tokens):
    assert all(isinstance(o.type, TokensType) for _, o in visible_options() if "--max-model-len" in o.opts)
    result = invoke("budget", "--model-config", QWEN, "--kv-cache-memory-bytes", "8GiB", "--max-model-len", text,
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["max_model_len"] == tokens
