"""``kvguard check`` in-process, ``kvguard serve`` as a real process on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from conftest import ROOT
from helpers import invoke
from monitoring import promtool
from sidecar_fixtures import free_port, snapshot, write
from test_collector_vllm import FakeVllm

from kvguard.cli import serve as cli_serve


def check(*args):
    return invoke("check", *args)


def test_check_exits_0_when_every_rank_is_ok(tmp_path):
    write(tmp_path, snapshot(kv_blocks=1000))
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK")


def test_check_exits_1_on_warning(tmp_path):
    write(tmp_path, snapshot())
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 1
    assert "overcommitted" in result.output


def test_check_exits_2_on_critical_and_says_why(tmp_path):
    write(tmp_path, snapshot(utilization=0.99))
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 2
    assert result.output.startswith("CRITICAL")
    assert "projected_peak_exceeds_capacity" in result.output


def test_check_json_is_the_guard_verdict(tmp_path):
    write(tmp_path, snapshot(rank=0, pid=1), snapshot(rank=1, device="npu:1", pid=2, utilization=0.99))
    result = check("--spool-dir", str(tmp_path), "--json")
    data = json.loads(result.output)
    assert data["state"] == "critical"
    assert [r["state"] for r in data["ranks"]] == ["warning", "critical"]


def test_check_counts_ooms_since_process_start(tmp_path):
    write(tmp_path, snapshot(kv_blocks=1000, ooms=1))
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 2 and "ooms_climbing" in result.output


def test_check_from_a_log(data_path):
    result = check("--from-log", data_path("logs", "v1-tp2-debug.log"), "--json")
    assert result.exit_code == 0
    assert json.loads(result.output)["ranks"][0]["stock_budget_bytes"] > 0


def test_check_exits_3_with_nothing_to_check():
    result = check()
    assert result.exit_code == 3
    assert result.output.strip() == "Error: nothing to check: give --spool-dir, --from-log or --vllm-metrics-url"


def test_check_on_an_empty_spool_is_unknown_with_the_no_ranks_reason_guard_gives(tmp_path):
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 3  # UNKNOWN: no verdict, never ok
    assert (
        result.output == f"UNKNOWN  no_ranks: no rank judged (no snapshots in {tmp_path}): the guard cannot "
        f"say the KV cache fits\n"
    )
    data = json.loads(check("--spool-dir", str(tmp_path), "--json").output)
    assert data["state"] == "unknown" and data["ranks"] == []  # the JSON says what exit 3 says
    assert [r["code"] for r in data["reasons"]] == ["no_ranks"]


def test_check_from_the_bundled_log_uses_its_profile_and_names_what_it_lacks():
    result = check(
        "--from-log", os.path.join(ROOT, "exporter", "kvguard", "examples", "vllm-mindspore-qwen2.5-7b.log"), "--json"
    )
    assert result.exit_code == 3, result.output  # could not judge
    rank = json.loads(result.output)["ranks"][0]
    assert rank["state"] == "unknown" and rank["kv_cache_bytes"] == round(37.85 * (1 << 30))
    message = rank["reasons"][0]["message"]
    assert "no --from-log" not in message
    assert "(vllm-mindspore 0.2.0)" in message and "states the weights, the KV cache vLLM decided" in message
    assert "but not the device's total memory, gpu_memory_utilization (the activation peak follows" in message


@pytest.mark.parametrize(("utilization", "state", "headroom_gib"), [(0.9, "ok", 6.4), (0.99, "ok", 0.64)])
def test_check_from_the_bundled_log_with_what_it_lacks_gives_a_real_verdict(utilization, state, headroom_gib):
    log = os.path.join(ROOT, "exporter", "kvguard", "examples", "vllm-mindspore-qwen2.5-7b.log")
    result = check("--from-log", log, "--total-memory", "64GiB", "--gpu-memory-utilization", str(utilization), "--json")
    rank = json.loads(result.output)["ranks"][0]
    assert (result.exit_code, rank["state"], rank["profile_origin"]) == (0, state, "log")
    # vllm-mindspore budgets from the reserved peak: the stock budget fills total x util, the rest is headroom.
    assert rank["headroom_bytes"] == pytest.approx(headroom_gib * (1 << 30), abs=1 << 24)
    assert rank["stock_budget_bytes"] == rank["kv_cache_bytes"] == round(37.85 * (1 << 30))


def test_check_refuses_log_figures_without_a_log(tmp_path):
    result = check("--spool-dir", str(tmp_path), "--total-memory", "64GiB")
    assert result.exit_code == 3 and "give --from-log" in result.output


def test_check_exits_3_on_a_log_without_vllm_lines(data_path):
    result = check("--from-log", data_path("logs", "garbage.log"))
    assert result.exit_code == 3
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_check_exits_3_on_a_missing_log(tmp_path):
    result = check("--from-log", str(tmp_path / "absent.log"))
    assert result.exit_code == 3 and result.output == f"Error: log file not found: {tmp_path / 'absent.log'}\n"


def test_check_refuses_a_log_that_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "vllm.log"
    os.mkfifo(fifo)  # no writer: opening it the ordinary way would wait forever
    result = invoke("check", "--from-log", str(fifo), seconds=30)
    assert result.exit_code == 3
    assert result.output == f"Error: cannot read log file {fifo}: not a regular file\n"


def test_check_says_why_there_is_nothing_to_judge():
    url = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    result = check("--vllm-metrics-url", url, "--read-timeout", "5")
    assert result.exit_code == 3
    assert result.output.startswith(f"UNKNOWN  no_ranks: no rank judged (vllm_metrics down: {url}: ")
    assert len(result.output.splitlines()) == 1


def test_check_counts_hostile_spool_files_and_judges_the_rest(tmp_path):
    write(tmp_path, snapshot(kv_blocks=1000))
    (tmp_path / "evil.json").write_text('{"kind": "kvguard.snapshot", "schema": 1, "memory": []}')
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 0
    assert "1 spool file(s) skipped: invalid_snapshot 1" in result.output


def test_check_against_a_hanging_vllm_ends_with_the_no_ranks_warning():
    server = FakeVllm("hang")
    try:
        result = invoke("check", "--vllm-metrics-url", server.url, "--read-timeout", "0.2", seconds=60)
        assert result.exit_code == 3 and "no_ranks" in result.output
        assert "Traceback" not in result.output
    finally:
        server.close()


# ------------------------------------------------------------------------------ serve


class Served:
    def __init__(self, *args: str):
        env = {
            **os.environ,
            "PYTHONPATH": os.path.join(ROOT, "exporter"),
            "POD_NAME": "vllm-0",
            "POD_NAMESPACE": "llm",
            "CONTAINER_NAME": "kvguard",
        }
        env.pop("KVGUARD_SPOOL_DIR", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvguard", "serve", "--listen", "127.0.0.1", "--port", "0", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.banner = self.process.stderr.readline()
        if "kvguard serve: http" not in self.banner:
            self.stop()
            raise AssertionError(f"serve did not start: {self.banner}{self.process.stderr.read()}")
        self.base = self.banner.split()[2].rsplit("/metrics", 1)[0]

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def poll(self, path: str, ready, deadline_seconds: float = 60.0):
        deadline = time.monotonic() + deadline_seconds
        while True:
            status, body = self.get(path)
            if ready(status, body) or time.monotonic() > deadline:
                return status, body
            time.sleep(0.2)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self.process.stderr.close()
        return self.process.returncode


@pytest.fixture
def served():
    started = []

    def start(*args):
        server = Served(*args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_serve_prints_where_to_look_and_answers_metrics(served, tmp_path):
    write(tmp_path, snapshot())
    server = served("--spool-dir", str(tmp_path), "--source", "none")
    assert server.base.startswith("http://127.0.0.1:")
    status, body = server.get("/metrics")
    assert status == 200 and b'pod="vllm-0"' in body


def test_serve_stops_cleanly_on_sigterm(served, tmp_path):
    server = served("--spool-dir", str(tmp_path), "--source", "none")
    assert server.stop() == 0


def test_serve_fails_readiness_on_critical_when_asked(served, tmp_path):
    write(tmp_path, snapshot(utilization=0.99))
    server = served("--spool-dir", str(tmp_path), "--source", "none", "--fail-readiness-on-critical")
    assert server.get("/readyz")[0] == 503


def test_demo_shows_fragmentation_and_a_guard_that_trips(served):
    server = served("--demo", "--demo-ranks", "2")
    banner = server.process.stderr.readline() + server.process.stderr.readline()
    assert "demo: 2 simulated rank(s)" in banner

    def tripped(status, body):
        if status != 200:
            return False
        ranks = json.loads(body)["ranks"]
        return len(ranks) == 2 and ranks[-1]["state"] == "critical"

    status, body = server.poll("/guard", tripped)
    guard = json.loads(body)
    assert guard["state"] == "critical" and guard["ranks"][0]["state"] in ("ok", "warning")
    status, metrics = server.get("/metrics")
    assert b'kvguard_allocator_fragmentation_bytes{container="kvguard",device="npu:0"' in metrics
    lint = subprocess.run([promtool(), "check", "metrics"], input=metrics, capture_output=True, timeout=60)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, b"")


def banner_lines(server: Served) -> list[str]:
    """The banner after its first line: the spool and sources line, then the demo's lines."""
    lines = [server.process.stderr.readline()]
    while lines[-1] and "look at:" not in lines[-1] and len(lines) < 10:
        lines.append(server.process.stderr.readline())
    return lines


def test_demo_says_it_caps_the_interval(served):
    server = served("--demo", "--interval", "5")
    (demo,) = [line for line in banner_lines(server) if "demo:" in line]
    assert "every 1s (--interval 5 capped at 1s in the demo)" in demo


def test_demo_reports_the_hosts_memory_as_a_device_source(served):
    server = served("--demo")
    status, metrics = server.poll("/metrics", lambda status, body: b'source="host"' in body)
    assert (
        b'kvguard_device_total_bytes{container="kvguard",device="host",device_uuid="",namespace="llm",'
        b'pci_bus_id="",pod="vllm-0",source="host"}' in metrics
    )


def test_serve_without_a_spool_dir_reads_no_spool(served):
    server = served("--source", "none")
    status, body = server.get("/guard")
    assert status == 200 and "spool" not in json.loads(body)["sources"]
    assert b'source="spool"' not in server.get("/metrics")[1]


def test_serve_refuses_a_log_that_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "vllm.log"
    os.mkfifo(fifo)
    result = invoke("serve", "--port", "0", "--source", "none", "--from-log", str(fifo), seconds=30)
    assert result.exit_code == 65
    assert result.output == f"Error: cannot read log file {fifo}: not a regular file\n"


def test_demo_with_an_unusable_spool_dir_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    spool = tmp_path / "afile" / "spool"
    result = invoke("serve", "--demo", "--listen", "127.0.0.1", "--port", "0", "--spool-dir", str(spool))
    assert result.exit_code == 65
    assert result.output == f"Error: cannot create spool directory {spool}: Not a directory\n"


def test_demo_without_a_writable_tmp_makes_its_spool_in_dev_shm(tmp_path, monkeypatch):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("this machine has no writable /dev/shm")
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "afile"))  # like a read-only /tmp
    with socket.socket() as taken:  # stop serve once the spool exists: the port is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke("serve", "--demo", "--listen", "127.0.0.1", "--port", str(port))
    assert result.exit_code == 65
    assert result.output.startswith(f"Error: cannot listen on 127.0.0.1:{port}")


def test_demo_with_nowhere_to_make_its_spool_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(cli_serve, "DEMO_SPOOL_PARENTS", (str(tmp_path / "afile"), None))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "afile"))
    result = invoke("serve", "--demo", "--listen", "127.0.0.1", "--port", "0")
    assert result.exit_code == 65
    assert result.output.startswith("Error: cannot create a demo spool directory (")
    assert len(result.output.splitlines()) == 1


def test_serve_on_a_taken_port_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke(
            "serve", "--listen", "127.0.0.1", "--port", str(port), "--spool-dir", str(tmp_path), "--source", "none"
        )
    assert result.exit_code == 65
    assert result.output.startswith(f"Error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in result.output


def test_serve_with_a_missing_certificate_says_tls(tmp_path):
    result = invoke(
        "serve",
        "--listen",
        "127.0.0.1",
        "--port",
        "0",
        "--source",
        "none",
        "--tls-cert-file",
        str(tmp_path / "tls.crt"),
        "--tls-key-file",
        str(tmp_path / "tls.key"),
    )
    assert result.exit_code == 65
    assert result.output == "Error: cannot load TLS certificate or key: No such file or directory\n"


def test_serve_refuses_a_certificate_without_a_key(tmp_path):
    result = invoke("serve", "--tls-cert-file", str(tmp_path / "c.pem"))
    assert result.exit_code == 64 and "go together" in result.output


def test_serve_refuses_an_unknown_source(tmp_path):
    result = invoke("serve", "--spool-dir", str(tmp_path), "--source", "abacus", "--port", "0")
    assert result.exit_code == 65 and "unknown source 'abacus'" in result.output


# ------------------------------------------------------------------ hostile inputs


@pytest.mark.parametrize("user", ["", "   ", "$(KVGUARD_BASIC_AUTH_USER)"])
def test_serve_refuses_an_empty_or_unexpanded_basic_auth_user(tmp_path, user):
    password = tmp_path / "password"
    password.write_text("s3cret")
    result = invoke(
        "serve",
        "--port",
        "0",
        "--source",
        "none",
        f"--basic-auth-user={user}",
        "--basic-auth-password-file",
        str(password),
    )
    assert result.exit_code == 64
    assert "--basic-auth-user is" in result.output.strip().splitlines()[-1]


def test_serve_refuses_an_empty_basic_auth_password(tmp_path):
    password = tmp_path / "password"
    password.write_text("\n")
    result = invoke(
        "serve",
        "--port",
        "0",
        "--source",
        "none",
        "--basic-auth-user=prometheus",
        "--basic-auth-password-file",
        str(password),
    )
    assert result.exit_code == 64 and "password is empty" in result.output


def test_check_with_a_lone_surrogate_in_a_snapshot_prints_no_traceback(tmp_path):
    bad = snapshot(device="npu:\udcff")
    (tmp_path / "bad.json").write_text(json.dumps(bad.to_dict()))
    result = subprocess.run(
        [sys.executable, "-m", "kvguard", "check", "--spool-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert "Traceback" not in result.stderr
    assert result.returncode == 1 and "npu:\ufffd" in result.stdout


def test_check_that_fails_inside_says_so_in_one_line_and_exits_3(tmp_path, monkeypatch):
    write(tmp_path, snapshot())
    from kvguard.sidecar import core as sidecar

    def broken(self):
        raise KeyError("surprise")

    monkeypatch.setattr(sidecar.Sidecar, "observe", broken)
    result = check("--spool-dir", str(tmp_path))
    assert result.exit_code == 3
    assert result.output == "Error: cannot judge: KeyError: 'surprise'\n"


def test_demo_removes_its_spool_on_sighup_as_on_sigterm(served):
    """A closed terminal (SIGHUP) ends the demo as SIGTERM does: its spool in /dev/shm goes too."""
    server = served("--demo", "--source", "none")
    (spool_line,) = [line for line in banner_lines(server) if line.strip().startswith("spool ")]
    spool = spool_line.split()[1].rstrip(";")
    assert os.path.isdir(spool)
    server.process.send_signal(signal.SIGHUP)
    assert server.process.wait(timeout=30) == 0
    assert not os.path.exists(spool)


def test_check_leaves_out_a_rank_not_written_for_forget_after(tmp_path):
    """The runbook's "restart the engine": the old process's snapshot stays in the spool, unwritten."""
    write(tmp_path, snapshot(utilization=0.99, pid=10, written_at=time.time() - 100), snapshot(kv_blocks=1000, pid=11))
    result = check("--spool-dir", str(tmp_path), "--forget-after", "50")
    assert result.exit_code == 0, result.output
    assert "1 rank(s) aged out: not_written 1" in result.output


def test_check_post_mortem_judges_the_ranks_of_a_finished_run_however_old(tmp_path):
    """After a crash the dead rank is the one to read: --post-mortem keeps it, and its verdict."""
    write(tmp_path, snapshot(utilization=0.99, pid=10, written_at=time.time() - 1000))
    aged = check("--spool-dir", str(tmp_path))
    assert aged.exit_code == 3 and "no_ranks" in aged.output and "not_written 1" in aged.output, aged.output
    kept = check("--spool-dir", str(tmp_path), "--post-mortem", "--json")
    data = json.loads(kept.output)
    assert [rank["state"] for rank in data["ranks"]] == ["critical"], data
    assert kept.exit_code == 2


def test_check_post_mortem_does_not_take_forget_after(tmp_path):
    result = check("--spool-dir", str(tmp_path), "--post-mortem", "--forget-after", "5")
    assert result.exit_code == 3 and "does not take --forget-after" in result.output


def _listening_addresses(pid: int, port: int) -> set[str]:
    """The local IPv4 addresses the process's sockets listen on at ``port`` (/proc/net/tcp, state 0A)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    with open("/proc/net/tcp", encoding="ascii") as handle:
        for line in handle.readlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port and fields[9] in inodes:
                found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from /proc/net/tcp")
def test_serve_demo_binds_the_loopback_address_its_banner_prints():
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "exporter")}
    env.pop("KVGUARD_SPOOL_DIR", None)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "serve", "--demo", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = process.stderr.readline()
        assert banner.startswith(f"kvguard serve: http://127.0.0.1:{port}/metrics"), banner
        assert _listening_addresses(process.pid, port) == {"127.0.0.1"}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        process.stderr.close()
