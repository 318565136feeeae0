"""`kvguard serve --log.level/--log.format` and `--listen` for IPv6: the real command, on loopback.

The sidecar logs what changes, once per change: a source going down (vLLM's /metrics on a closed
port) and a rank's guard state; the same world observed again logs nothing more.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from sidecar_fixtures import GIB, free_port, snapshot, write

from kvguard import logs

POD_ENV = {"POD_NAME": "qwen-0", "POD_NAMESPACE": "llm", "CONTAINER_NAME": "vllm"}
LOGFMT_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def parse_logfmt(line: str) -> dict[str, str]:
    return {key: json.loads(value) if value.startswith('"') else value for key, value in LOGFMT_PAIR.findall(line)}


class Serve:
    def __init__(self, tmp_path, *args: str, listen: str = "127.0.0.1"):
        self.port = free_port()
        self.err = open(tmp_path / "serve.err", "w+b")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvguard",
                "serve",
                "--listen",
                listen,
                "--port",
                str(self.port),
                "--source",
                "none",
                "--interval",
                "0.2",
                *args,
            ],
            env={**os.environ, **POD_ENV},
            stdout=subprocess.DEVNULL,
            stderr=self.err,
            start_new_session=True,
        )

    def get(self, path: str, host: str = "127.0.0.1") -> int:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{host}:{self.port}{path}", timeout=5) as response:
                    response.read()
                    return response.status
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def lines(self) -> list[str]:
        self.err.seek(0)
        return [line for line in self.err.read().decode().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
        self.err.close()


@pytest.fixture
def spool(tmp_path):
    path = tmp_path / "spool"
    path.mkdir()
    # rank 0 fits but its KV cache is overcommitted (warning); rank 1 holds 70 GiB of a 64 GiB device.
    write(str(path), snapshot(0, "npu:0", 41), snapshot(1, "npu:1", 42, reserved=70 * GIB))
    return path


def json_events(serve: Serve) -> list[dict]:
    return [json.loads(line) for line in serve.lines() if line.startswith("{")]


def test_json_logs_name_a_failing_source_and_each_ranks_state_once(tmp_path, spool):
    closed = free_port()
    serve = Serve(
        tmp_path,
        "--spool-dir",
        str(spool),
        "--vllm-metrics-url",
        f"http://127.0.0.1:{closed}/metrics",
        "--read-timeout",
        "0.5",
        "--log.format",
        "json",
    )
    try:
        for _ in range(4):  # observed four times: each change is logged once
            serve.get("/metrics")
            serve.get("/readyz")
            time.sleep(0.3)
        events = json_events(serve)
    finally:
        serve.stop()
    assert all(
        set(e) >= {"ts", "level", "msg"} and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["ts"])
        for e in events
    )
    down = [e for e in events if e["msg"] == "source down"]
    assert [(e["level"], e["source"]) for e in down] == [("warn", "vllm_metrics")]
    assert "Connection refused" in down[0]["error"] or "refused" in down[0]["error"].lower()
    states = [(e["rank"], e["state"], e["level"]) for e in events if e["msg"] == "guard state"]
    assert sorted(states) == [("0", "warning", "warn"), ("1", "critical", "error")], events
    critical = next(e for e in events if e["msg"] == "guard state" and e["rank"] == "1")
    assert "projected_peak_exceeds_capacity" in critical["reasons"].split(",")
    assert critical["pod"] == "vllm-0" and critical["engine_id"] == "vllm-0"  # the snapshot's pod
    # ranks of different processes print different lines: each names its pid
    assert {(e["rank"], e["pid"]) for e in events if e["msg"] == "guard state"} == {("0", "41"), ("1", "42")}


def test_a_rank_that_changes_state_is_logged_again_in_logfmt(tmp_path, spool):
    serve = Serve(tmp_path, "--spool-dir", str(spool))
    try:
        serve.get("/metrics")
        time.sleep(0.3)
        serve.get("/metrics")
        write(str(spool), snapshot(1, "npu:1", 42))  # rank 1's reserved back inside the device
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            serve.get("/readyz")
            lines = [parse_logfmt(line) for line in serve.lines() if 'msg="guard state"' in line]
            if len([e for e in lines if e["rank"] == "1"]) >= 2:
                break
            time.sleep(0.3)
    finally:
        serve.stop()
    rank1 = [(e["previous"], e["state"]) for e in lines if e["rank"] == "1"]
    assert rank1 == [("", "critical"), ("critical", "warning")]
    assert [e["level"] for e in lines if e["rank"] == "1"] == ["error", "warn"]


def test_log_level_error_keeps_only_errors(tmp_path, spool):
    serve = Serve(tmp_path, "--spool-dir", str(spool), "--log.level", "error")
    try:
        serve.get("/metrics")
        time.sleep(0.3)
        lines = [parse_logfmt(line) for line in serve.lines() if line.startswith("ts=")]
    finally:
        serve.stop()
    assert [(e["level"], e["rank"]) for e in lines] == [("error", "1")]


@pytest.mark.parametrize("flag, value", [("--log.level", "loud"), ("--log.format", "xml")])
def test_a_bad_log_flag_is_one_usage_line(flag, value):
    result = subprocess.run(
        [sys.executable, "-m", "kvguard", "serve", flag, value], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 64  # usage
    assert f"Invalid value for '{flag}'" in result.stderr and "Traceback" not in result.stderr


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("listen", ["[::]", "::"])
def test_listen_on_every_ipv6_address_serves_ipv6_and_ipv4_clients(tmp_path, spool, listen):
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    serve = Serve(tmp_path, "--spool-dir", str(spool), listen=listen)
    try:
        assert serve.get("/healthz", host="[::1]") == 200
        if open("/proc/sys/net/ipv6/bindv6only").read().strip() == "0":  # dual stack: IPv4 mapped
            assert serve.get("/healthz", host="127.0.0.1") == 200
    finally:
        serve.stop()


def test_the_banner_names_an_ipv6_listener_as_a_url():
    from kvguard.sidecar.server import KVGuardServer

    class Fake:
        options = type("O", (), {"listen": "::"})()
        scheme, port = "http", 10240

    assert KVGuardServer.url(Fake(), "/metrics") == "http://[::1]:10240/metrics"


def test_logfmt_quotes_what_logfmt_must_and_json_is_one_object_a_line():
    stream = io.StringIO()
    logger = logs.setup("debug", "logfmt", stream)
    logs.event(logger, logging.WARNING, "source down", source="npu-smi", error='exit 1: "npu-smi" not found')
    line = stream.getvalue().strip()
    assert re.fullmatch(
        r'ts=\S+ level=warn msg="source down" source=npu-smi error="exit 1: \\"npu-smi\\" not found"', line
    ), line
    stream = io.StringIO()
    logger = logs.setup("info", "json", stream)
    logs.event(logger, logging.DEBUG, "hidden")
    logs.event(logger, logging.ERROR, "guard state", rank="1", headroom_bytes=-5)
    (only,) = stream.getvalue().splitlines()
    assert json.loads(only) | {"ts": None} == {
        "ts": None,
        "level": "error",
        "msg": "guard state",
        "rank": "1",
        "headroom_bytes": -5,
    }


# C0/C1 controls, DEL, line and paragraph separators, bidi marks, overrides and isolates (CVE-2021-42574).
HOSTILE = "vllm\x1b[2J\x07-0\u202egnp.exe\u2066x\u2069\u2028level=info\x85\u200f\u061c\x7f"
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_a_spool_writers_control_and_bidi_characters_are_escaped_in_log_lines(tmp_path, fmt):
    """A pod name from the spool (any container of the pod writes it) reaches the guard-state line:
    the line holds none of the characters a terminal acts on, and what it carries reads back unchanged
    (the spool's reader already replaces C0 controls; bidi overrides and isolates pass it)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    write(
        str(spool),
        snapshot(1, "npu:1", 42, reserved=70 * GIB, pod={"pod": HOSTILE, "namespace": "llm", "container": "vllm"}),
    )
    serve = Serve(tmp_path, "--spool-dir", str(spool), "--log.format", fmt)
    try:
        serve.get("/metrics")
        time.sleep(0.3)
        serve.err.seek(0)
        raw = serve.err.read().decode()
    finally:
        serve.stop()
    lines = [line for line in raw.split("\n") if "guard state" in line]
    assert len(lines) == 1, raw
    assert not UNSAFE.search(lines[0]), repr(lines[0])
    event = json.loads(lines[0]) if fmt == "json" else parse_logfmt(lines[0])
    assert event["level"] == "error" and "\u202egnp.exe\u2066x\u2069" in event["pod"]


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_a_lone_surrogate_is_escaped_so_a_strict_utf8_stream_can_write_the_line(fmt):
    stream = io.StringIO()
    logger = logs.setup("info", fmt, stream)
    logs.event(logger, logging.WARNING, "guard state", pod="vllm-\udcff-0")
    line = stream.getvalue().strip()
    line.encode("utf-8")  # raises on a raw lone surrogate
    event = json.loads(line) if fmt == "json" else parse_logfmt(line)
    assert event["pod"] == "vllm-\udcff-0"
