"""The HTTP endpoints, on loopback, against real snapshots; promtool lints the live /metrics."""

from __future__ import annotations

import gzip
import http.client
import json
import shutil
import socket
import ssl
import subprocess

import pytest
from monitoring import promtool
from sidecar_fixtures import basic, http_get as get, snapshot


def test_metrics_is_prometheus_text_by_default(serve):
    server = serve(snapshot())
    status, headers, body = get(server, "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'kvguard_allocator_reserved_bytes{container="vllm",device="npu:0"' in body


def test_metrics_is_openmetrics_when_accept_asks(serve):
    server = serve(snapshot())
    status, headers, body = get(server, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    assert b"kvguard_allocator_ooms_total" in body


def test_metrics_is_gzipped_when_the_client_accepts_it(serve):
    server = serve(snapshot())
    status, headers, body = get(server, "/metrics", {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert b"kvguard_build_info" in gzip.decompress(body)


@pytest.mark.parametrize("utilization", [0.9, 0.99], ids=["warning", "critical"])
def test_promtool_check_metrics_finds_nothing_on_the_live_endpoint(serve, utilization):
    server = serve(
        snapshot(rank=0, pid=10, utilization=utilization),
        snapshot(rank=1, device="npu:1", pid=11, utilization=utilization, retries=2, ooms=1),
    )
    status, _, body = get(server, "/metrics")
    assert status == 200
    result = subprocess.run([promtool(), "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, b"")


def test_healthz_answers_ok(serve):
    assert get(serve(), "/healthz")[::2] == (200, b"ok\n")


def test_readyz_stays_ready_when_critical_without_the_flag(serve):
    server = serve(snapshot(utilization=0.99))
    assert get(server, "/readyz")[0] == 200


def test_readyz_fails_when_critical_with_the_flag(serve):
    server = serve(snapshot(utilization=0.99), fail_readiness_on_critical=True)
    status, _, body = get(server, "/readyz")
    assert status == 503
    assert b"projected_peak_exceeds_capacity" in body


def test_readyz_is_ready_with_the_flag_when_nothing_is_critical(serve):
    assert get(serve(snapshot(), fail_readiness_on_critical=True), "/readyz")[0] == 200


def test_guard_answers_the_verdict_per_rank_with_reasons(serve):
    server = serve(snapshot(rank=0, pid=10), snapshot(rank=1, device="npu:1", pid=11, utilization=0.99))
    status, headers, body = get(server, "/guard")
    assert status == 200 and headers["Content-Type"] == "application/json"
    guard = json.loads(body)
    assert guard["state"] == "critical"
    by_rank = {r["rank"]: r for r in guard["ranks"]}
    assert by_rank["0"]["state"] == "warning"
    assert [r["code"] for r in by_rank["0"]["reasons"]] == ["overcommitted"]
    assert by_rank["1"]["state"] == "critical"
    assert by_rank["1"]["headroom_bytes"] < 0


def test_anything_else_is_404(serve):
    server = serve()
    for path in ("/index.html", "//", "/metrics/", "/debug", "/../etc/passwd"):
        assert get(server, path)[0] == 404


def test_head_has_no_body(serve):
    status, headers, body = get(serve(snapshot()), "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_post_is_not_allowed(serve):
    assert get(serve(), "/metrics", method="POST")[0] == 405


def test_basic_auth_refuses_without_credentials(serve):
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    status, headers, _ = get(server, "/metrics")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
    assert get(server, "/metrics", basic("prometheus", "wrong"))[0] == 401
    assert get(server, "/guard", {"Authorization": "Basic !!!not-base64"})[0] == 401


def test_basic_auth_admits_the_right_credentials(serve):
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    assert get(server, "/metrics", basic("prometheus", "s3cret"))[0] == 200


def test_probes_stay_open_under_basic_auth(serve):
    server = serve(basic_auth_user="prometheus", basic_auth_password="s3cret")
    assert get(server, "/healthz")[0] == 200
    assert get(server, "/readyz")[0] == 200


@pytest.fixture
def certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def test_tls_serves_metrics_over_https(serve, certificate):
    cert, key = certificate
    server = serve(snapshot(), tls_cert_file=cert, tls_key_file=key)
    context = ssl.create_default_context(cafile=cert)
    status, _, body = get(server, "/metrics", context=context)
    assert status == 200 and b"kvguard_guard_state" in body
    assert server.url("/metrics").startswith("https://127.0.0.1:")


def test_tls_refuses_plain_http(serve, certificate):
    cert, key = certificate
    server = serve(tls_cert_file=cert, tls_key_file=key)
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        status, _, _ = get(server, "/healthz")
        assert status >= 400  # some stacks answer 400 instead of dropping the connection
        raise ConnectionError("plain request refused")


def test_plain_http_on_the_tls_port_is_one_line_on_stderr(serve, certificate, capfd):
    cert, key = certificate
    server = serve(tls_cert_file=cert, tls_key_file=key)
    capfd.readouterr()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            while plain.recv(4096):  # the server logs, then closes the connection
                pass
        except ConnectionResetError:  # closed with the unread plain request still queued
            pass
    err = capfd.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("kvguard serve: connection from 127.0.0.1: ") and "SSL" in line
    assert server.connection_errors_total == 1


def test_plain_http_on_the_tls_port_gets_a_400_that_says_so(serve, certificate):
    """As Go's net/http answers it (server.go: "Client sent an HTTP request to an HTTPS server."),
    so a curl without https:// reads why, instead of a closed connection."""
    cert, key = certificate
    server = serve(tls_cert_file=cert, tls_key_file=key)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := plain.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 400 Bad Request\r\n")
    assert answer.endswith(b"\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")
