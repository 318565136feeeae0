"""One set of conventions for every command (issue 35): what a SIZE is, one name per quantity, old names kept
as aliases that warn, every recommendation a flag the tool takes back, and one exit code for one mistake."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import click
import pytest
from click.testing import CliRunner
from conftest import EXAMPLES, TESTS

from kvguard.cli import exits, main
from kvguard.cli.options import SizeType, TokensType
from kvguard.units import parse_size

QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")
SEED_PROFILE = os.path.join(EXAMPLES, "qwen2.5-7b-910b-profile.json")
GIB = 1 << 30

# Flags that name one quantity, as users have typed them or other tools spell them. Exactly one spelling of
# each may be a visible option of any command; the others are at most hidden aliases.
SYNONYMS = {
    "the device's total memory": (
        "--total-memory",
        "--device-memory",
        "--gpu-memory",
        "--device-capacity",
        "--total-gpu-memory",
        "--capacity",
    ),
    "the KV cache memory": ("--kv-cache-memory-bytes", "--kv-cache-memory", "--kv-cache-bytes", "--kv-cache-size"),
    "tokens per request": ("--max-model-len", "--max-seq-len", "--max-model-length", "--context-length"),
    "the utilization": ("--gpu-memory-utilization", "--utilization", "--memory-utilization"),
    "memory outside the allocator": ("--non-allocator-memory", "--non-torch-allocator-memory"),
}


# The one exit-code table (kvguard.cli.exits), pinned as numbers: renumbering it breaks every script that reads it.
# check is a Nagios plugin: Nagios Core reads a code above 3 as CRITICAL, so its every error is UNKNOWN (3).
USAGE_IN = {name: 3 if name == "check" else 64 for name in main.commands}
DATAERR_IN = {name: 3 if name == "check" else 65 for name in main.commands}
MISSING = os.path.join(os.sep, "nonexistent", "kvguard-test")


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
    return [
        (name, option.opts[0])
        for name, option in visible_options()
        if isinstance(option.type, SizeType) and option.opts[0].startswith("--")
    ]


def test_every_command_that_takes_a_size_states_what_a_size_is_in_its_help():
    commands = {name for name, _ in size_options()}
    assert {"budget", "check", "simulate", "plan"} <= commands
    for name in commands:
        text = " ".join(invoke(name, "--help").output.split())
        assert "64GB is 64,000,000,000 bytes (59.60 GiB)" in text and "64GiB is 68,719,476,736 bytes" in text, name


@pytest.mark.parametrize(("command", "flag"), size_options())
def test_a_bare_number_is_refused_by_every_size_option_with_the_units_listed(command, flag):
    result = invoke(command, flag, "64")
    assert result.exit_code == USAGE_IN[command], result.output
    if "BYTES|SIZE" in invoke(command, "--help").output and flag == "--kv-cache-memory-bytes":
        return  # named in bytes: a bare number is bytes there (tested below)
    assert f"Invalid value for '{flag}': '64' has no unit" in result.output
    assert "KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024)" in result.output


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64GB", 64_000_000_000),
        ("64GiB", 64 * GIB),
        ("64Gi", 64 * GIB),
        ("512MiB", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("0", 0),
        ("4096B", 4096),
    ],
)
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
    assert json.loads(old.output[old.output.index("{") :]) == json.loads(new.output)
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
    assert json.loads(old.output[old.output.index("{") :])["num_blocks"] == json.loads(new.output)["num_blocks"]


@pytest.mark.parametrize(("text", "tokens"), [("32768", 32768), ("32k", 32_000), ("32K", 32_768)])
def test_max_model_len_reads_as_vllm_reads_it_in_every_command(text, tokens):
    assert all(isinstance(o.type, TokensType) for _, o in visible_options() if "--max-model-len" in o.opts)
    result = invoke(
        "budget", "--model-config", QWEN, "--kv-cache-memory-bytes", "8GiB", "--max-model-len", text, "--json"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["max_model_len"] == tokens


# ------------------------------------------------------------------ one exit code for one mistake


def test_the_exit_code_table_is_pinned_as_numbers():
    assert (exits.OK, exits.WARNING, exits.CRITICAL, exits.UNKNOWN) == (0, 1, 2, 3)
    assert (exits.USAGE, exits.DATAERR, exits.SOFTWARE) == (64, 65, 70)  # sysexits.h EX_USAGE, EX_DATAERR, EX_SOFTWARE
    assert exits.INTERRUPTED == 130  # 128 + SIGINT, as shells report it
    assert exits.OUTPUT_CLOSED == 141  # 128 + SIGPIPE, as shells report it
    assert [row.code for row in exits.TABLE] == [0, 1, 2, 3, 64, 65, 70, 130, 141]
    assert exits.NAGIOS_PLUGINS == ("check",)


def test_the_table_the_docs_show_is_the_one_the_commands_give():
    for name in main.commands:
        codes = dict(exits.codes_for(name))
        assert 0 in codes
        assert (64 in codes, 65 in codes, 70 in codes, 130 in codes, 141 in codes) == (
            (False,) * 5 if name == "check" else (True,) * 5
        ), name
        assert set(codes) <= {row.code for row in exits.TABLE}
    assert set(dict(exits.codes_for("plan"))) == {0, 2, 64, 65, 70, 130, 141}
    assert set(dict(exits.codes_for("simulate"))) == {0, 2, 64, 65, 70, 130, 141}
    assert set(dict(exits.codes_for("check"))) == {0, 1, 2, 3}


@pytest.mark.parametrize("command", sorted(main.commands))
def test_an_unknown_option_is_one_code_in_every_command(command):
    result = invoke(command, "--no-such-option")
    assert result.exit_code == USAGE_IN[command], result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    if command == "plan":  # the words after plan's own options are the serve command: not one, says plan
        assert len(errors) == 1 and errors[0].startswith("Error: not a vLLM serve command: '--no-such-option'")
    else:
        assert errors == ["Error: No such option '--no-such-option'."]


def test_no_command_and_an_unknown_command_are_usage_errors():
    assert invoke().exit_code == 64
    assert invoke("chek").exit_code == 64
    assert invoke("--no-such-option").exit_code == 64


@pytest.mark.parametrize(
    "args", [["--help"], ["-h"], ["--version"]] + [[name, "--help"] for name in sorted(main.commands)]
)
def test_help_and_version_exit_0(args):
    result = invoke(*args)
    assert result.exit_code == 0 and result.output, result.output


def test_every_command_is_in_the_table():
    assert sorted(main.commands) == ["budget", "check", "plan", "probe", "sample", "serve", "simulate"]


@pytest.mark.parametrize(
    "args",
    [
        ["budget", "--profile", MISSING],
        ["budget", "--from-log", MISSING],
        ["budget", "--model-config", MISSING],
        ["plan", "--device", "H100", "--model-config", MISSING, "--", "vllm", "serve", "M"],
        ["plan", "--device", "H100", "--profile", MISSING, "--model-config", QWEN, "--", "vllm", "serve", "M"],
        ["simulate", "--model-config", MISSING],
        ["simulate", "--trace", MISSING],
        ["simulate", "--ops", MISSING],
        ["serve", "--web.config.file", MISSING],
        ["serve", "--basic-auth-user", "u", "--basic-auth-password-file", MISSING],
        ["check", "--from-log", MISSING],
    ],
    ids=lambda args: " ".join(a for a in args if a != MISSING),
)
def test_a_missing_file_is_one_code_in_every_command(args):
    result = invoke(*args)
    assert result.exit_code == DATAERR_IN[args[0]], result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("Error: "), result.output


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--seed", "1", "--seed", "2"],
        ["simulate", "--ops", "x", "--trace", "y"],
        ["probe", "--source", "host", "--ranks", "2", "--spool-dir", MISSING],
        ["plan", "--device", "H100", "--model-config", QWEN, "--"],
        ["plan", "--device", "64", "--model-config", QWEN, "--", "vllm", "serve", "M"],
    ],
)
def test_options_that_do_not_go_together_are_a_usage_error_in_one_line(args):
    result = invoke(*args)
    assert result.exit_code == 64 and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    "args",
    [
        ["budget", "--vllm-version", "0.1.0", "--model-config", QWEN],
        ["simulate", "--vllm-version", "0.1.0"],
        ["plan", "--vllm-version", "0.1.0", "--device", "H100", "--model-config", QWEN, "--", "vllm", "serve", "M"],
        ["check", "--from-log", "x", "--total-memory", "64"],
    ],
)
def test_a_bad_option_value_is_one_code_in_every_command(args):
    assert invoke(*args).exit_code == USAGE_IN[args[0]]


def test_an_internal_error_is_one_line_and_70_but_unknown_in_check(monkeypatch):
    import kvguard.cli.check
    import kvguard.cli.plan

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.delenv("KVGUARD_DEBUG", raising=False)
    monkeypatch.setattr(kvguard.cli.plan, "make_plan", boom)
    result = invoke("plan", "--device", "H100", "--model-config", QWEN, "--", "vllm", "serve", "M")
    assert (result.exit_code, result.output) == (
        70,
        "Error: internal error: RuntimeError: boom (KVGUARD_DEBUG=1 shows the traceback)\n",
    )
    monkeypatch.setattr(kvguard.cli.check, "_check", boom)
    result = invoke("check", "--spool-dir", MISSING)
    assert (result.exit_code, result.output) == (3, "Error: cannot judge: RuntimeError: boom\n")


def _interrupted(args: list[str], started: str | None = None) -> subprocess.CompletedProcess:
    """``kvguard ARGS`` in its own process, sent SIGINT (Ctrl-C) once it is running (once ``started`` is on stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvguard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(2.0)  # past the imports: the command is at work
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_ctrl_c_stops_a_command_with_130_not_a_judges_warning():
    done = _interrupted(["simulate", "--requests", "1000000", "--long-fraction", "0.5"])
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "Aborted!"
    assert "Traceback" not in done.stderr


def test_ctrl_c_stops_check_with_unknown_as_a_nagios_plugin():
    hanging = socket.create_server(("127.0.0.1", 0))  # accepts and never answers
    try:
        url = f"http://127.0.0.1:{hanging.getsockname()[1]}/metrics"
        done = _interrupted(["check", "--vllm-metrics-url", url, "--read-timeout", "120"])
    finally:
        hanging.close()
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr


def _reader_gone(args: list[str]) -> subprocess.CompletedProcess:
    """``kvguard ARGS`` in its own process, its stdout a pipe whose read end is closed before it writes (as
    ``| head`` leaves it once it has its lines)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvguard", *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)
    return done


def test_a_reader_that_goes_away_stops_a_command_with_141_and_no_error():
    done = _reader_gone(["plan", "--device", "910B", "--model-config", QWEN, "--", "vllm", "serve", "M"])
    assert (done.returncode, done.stderr) == (141, "")


def test_a_reader_that_goes_away_stops_check_with_unknown_as_a_nagios_plugin():
    done = _reader_gone(["check", "--from-log", os.path.join(TESTS, "data", "logs", "eras", "v0.27-debug.log")])
    assert (done.returncode, done.stderr) == (3, "")


def test_a_broken_pipe_that_is_not_stdout_is_still_an_internal_error(monkeypatch):
    import kvguard.cli.plan

    def broken(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")  # a source's socket, say: stdout is fine

    monkeypatch.delenv("KVGUARD_DEBUG", raising=False)
    monkeypatch.setattr(kvguard.cli.plan, "make_plan", broken)
    result = invoke("plan", "--device", "H100", "--model-config", QWEN, "--", "vllm", "serve", "M")
    assert result.exit_code == 70 and "BrokenPipeError" in result.output, result.output
