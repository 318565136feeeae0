"""An exception as one line (kvguard.text.one_line): the only copy, called wherever an error crosses to a
user, a log line or a scrape. Each path below once had its own copy, and those copies called ``str(exc)``
bare: an exception whose ``__str__`` raises escaped as that second exception instead of one line."""

from __future__ import annotations

import json
import urllib.request

import pytest
from helpers import invoke, one_line_error

from kvguard.text import one_line


class HostileError(ValueError):
    """A third-party exception whose message cannot be built (a broken ``__str__``, seen in C extensions)."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")


def raise_hostile(*args, **kwargs):
    raise HostileError("never shown")


def test_one_line_joins_lines_and_falls_back_to_the_type_name():
    assert one_line(ValueError("first\n  second\tthird")) == "first second third"
    assert one_line(ValueError()) == "ValueError"
    assert one_line(HostileError()) == "HostileError"
    assert len(one_line(ValueError("x" * 1000))) == 300


def test_the_shapes_that_keep_the_first_line_or_name_the_type():
    error = ValueError("expected <block end>\n  in line 3:\n    password: hunter2")
    assert one_line(error, first_line=True) == "expected <block end>"
    assert one_line(error, first_line=True, with_type=True) == "ValueError: expected <block end>"
    assert one_line(KeyError(), with_type=True) == "KeyError"
    assert one_line(HostileError(), first_line=True, with_type=True) == "HostileError"


def test_a_spool_file_that_breaks_the_json_reader_is_a_snapshot_error(monkeypatch):
    from kvguard.spool.schema import SnapshotError, decode_snapshot

    monkeypatch.setattr(json, "loads", raise_hostile)
    with pytest.raises(SnapshotError) as caught:
        decode_snapshot(b"{}")
    assert caught.value.reason == "invalid_json"
    assert str(caught.value) == "HostileError"


def test_a_model_config_that_breaks_the_json_reader_is_a_config_error(monkeypatch, tmp_path):
    from kvguard.budget.estimator import ConfigError
    from kvguard.budget.model_config import load_model_config

    path = tmp_path / "config.json"
    path.write_text("{}")
    monkeypatch.setattr(json, "loads", raise_hostile)
    with pytest.raises(ConfigError, match=r"is not valid JSON: HostileError$"):
        load_model_config(str(path))


def test_a_vllm_metrics_fetch_that_fails_oddly_is_a_metrics_error(monkeypatch):
    from kvguard.vllm.metrics import VllmMetricsError, fetch

    monkeypatch.setattr(urllib.request.OpenerDirector, "open", raise_hostile)
    with pytest.raises(VllmMetricsError, match=r"^http://127\.0\.0\.1:9/metrics: HostileError$"):
        fetch("http://127.0.0.1:9/metrics", timeout=5)


def test_a_web_config_the_yaml_reader_fails_on_is_a_web_config_error(monkeypatch):
    import yaml

    from kvguard.sidecar.webconfig import WebConfigError, parse_web_config

    monkeypatch.setattr(yaml, "safe_load", raise_hostile)
    with pytest.raises(WebConfigError, match=r"^not valid YAML: HostileError$"):
        parse_web_config("tls_server_config: {}\n")


def test_a_trace_reader_failure_is_one_line_from_simulate(monkeypatch, tmp_path):
    from kvguard.allocators import traces

    path = tmp_path / "memory_block.csv"
    path.write_text("size,start_time_stamp\n1,2\n")
    monkeypatch.setattr(traces, "load_trace", raise_hostile)
    line = one_line_error(invoke("simulate", "--allocator", "mindspore", "--trace", str(path)))
    assert line == f"Error: cannot read trace {path}: HostileError"
