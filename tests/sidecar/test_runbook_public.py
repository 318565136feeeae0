"""`kvguard serve --web.runbook-public`: the alerts' runbook links open without the scrape's credentials,
and nothing else does. The real command, on loopback, with basic auth on."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml
from conftest import ROOT
from sidecar_fixtures import free_port

PASSWORD = "s3cret-for-prometheus"


def status(port: int, path: str, credentials: bool = False) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if credentials:
        token = base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(*flags: str) -> int:
        password = tmp_path / "password"
        password.write_text(PASSWORD)
        port = free_port()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvguard",
                "serve",
                "--listen",
                "127.0.0.1",
                "--port",
                str(port),
                "--source",
                "none",
                "--basic-auth-user",
                "prometheus",
                "--basic-auth-password-file",
                str(password),
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        started.append(process)
        deadline = time.monotonic() + 30
        while True:
            try:
                if status(port, "/healthz") == 200:
                    return port
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)


def test_without_the_flag_the_runbook_is_behind_basic_auth(serve):
    port = serve()
    assert status(port, "/runbook") == 401
    assert status(port, "/runbook", credentials=True) == 200


def shipped_alerts() -> list[str]:
    with open(os.path.join(ROOT, "dashboards", "rules", "kvguard-alerts.yaml"), encoding="utf-8") as handle:
        groups = yaml.safe_load(handle)["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_with_the_flag_every_alerts_page_opens_without_credentials_and_metrics_stay_behind_auth(serve):
    port = serve("--web.runbook-public")
    assert status(port, "/runbook") == 200
    alerts = shipped_alerts()
    assert len(alerts) >= 5
    for alert in alerts:
        assert status(port, f"/runbook/{alert}") == 200, alert
    assert status(port, "/runbook/NoSuchAlert") == 404
    for path in ("/metrics", "/guard", "/"):
        assert status(port, path) == 401, path
        assert status(port, path, credentials=True) == 200, path
