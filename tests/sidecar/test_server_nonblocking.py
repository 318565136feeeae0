"""No client can hold a worker, and credentials cost nothing to the legitimate (issue 23, parts 1-2):
the server writes without blocking, answers the probes in its event loop, queues instead of
refusing, and keeps verified credentials apart from guesses. On loopback, real sockets; every
wait has a generous bound and nothing asserts a duration."""

from __future__ import annotations

import base64
import http.client
import os
import secrets
import socket
import threading
import time

import bcrypt
import pytest
from helpers import wait_for
from sidecar_fixtures import http_get, snapshot

from kvguard.sidecar.webconfig import BasicAuth, GuessLimiter, WebConfigWatcher

PIPELINED = 200


def slow_reader(port: int, path: str = "/metrics", requests: int = PIPELINED) -> socket.socket:
    """The issue's slow reader: a 1 KiB receive window, ``requests`` pipelined GETs, never a read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window it offers
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * requests)
    return sock


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """(status, body) of ``count`` answers read in order from one connection (Content-Length framed)."""
    stream = sock.makefile("rb")
    answers = []
    for _ in range(count):
        status = int(stream.readline().split()[1])
        length = 0
        while (line := stream.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        answers.append((status, stream.read(length)))
    return answers


def ranks(count: int) -> list:
    return [snapshot(rank=rank, device=f"npu:{rank}", pid=1000 + rank) for rank in range(count)]


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_healthz_is_answered_while_slow_readers_hold_unsent_output(serve):
    server = serve(*ranks(16), workers=2)
    readers = [slow_reader(server.port) for _ in range(8)]  # the eight; four times the workers
    try:
        assert wait_for(lambda: server.unsent_bytes > 0)
        assert http_get(server, "/healthz", timeout=10)[0] == 200
        assert http_get(server, "/readyz", timeout=10)[0] == 200
        assert server.unsent_bytes > 0  # the slow readers still had their answers queued throughout
    finally:
        for sock in readers:
            sock.close()


def test_a_scrape_is_answered_while_slow_readers_hold_unsent_output(serve):
    server = serve(*ranks(16), workers=2)
    readers = [slow_reader(server.port) for _ in range(8)]
    try:
        assert wait_for(lambda: server.unsent_bytes > 0)
        status, _, body = http_get(server, "/metrics", timeout=10)
        assert status == 200 and b"kvguard_guard_state" in body
        assert server.unsent_bytes > 0
    finally:
        for sock in readers:
            sock.close()


def test_a_slow_reader_is_read_no_further_while_its_output_is_over_the_bound(serve):
    server = serve(*ranks(16), output_limit=64 * 1024)
    reader = slow_reader(server.port)
    try:
        assert wait_for(lambda: server.unsent_bytes > 0)
        time.sleep(0.2)  # let the loop do whatever it would do next
        # Of 200 pipelined requests, one answer past the bound is queued (each /metrics body
        # is about 120 kB here), not 200 of them.
        assert server.unsent_bytes < 2 * 130 * 1024
    finally:
        reader.close()


def test_a_reader_that_never_drains_is_closed_after_the_request_timeout(serve):
    server = serve(*ranks(16), request_timeout=0.5)
    reader = slow_reader(server.port)
    try:
        assert wait_for(lambda: server.write_timeouts_total == 1)
        assert server.open_connections == 0
    finally:
        reader.close()


def test_a_peer_that_stops_sending_still_gets_its_answers(serve):
    server = serve(*ranks(16))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        sock.shutdown(socket.SHUT_WR)
        answers = read_answers(sock, 3)
    assert [status for status, _ in answers] == [200] * 3
    assert all(b"kvguard_guard_state" in body for _, body in answers)


def test_256_concurrent_clients_get_no_503(serve):
    server = serve(*ranks(16))
    clients = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(256)]
    try:
        for sock in clients:  # all 256 asked before any answer is read
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        statuses = []
        for sock in clients:
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            answer.read()
            statuses.append(answer.status)
        assert statuses == [200] * 256
    finally:
        for sock in clients:
            sock.close()


def test_pipelined_requests_are_answered_in_order(serve):
    server = serve(snapshot())
    paths = ["/healthz", "/metrics", "/nope", "/readyz", "/guard", "/healthz"] * 10
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"".join(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for path in paths))
        got = [(status, body[:2]) for status, body in read_answers(sock, len(paths))]
    expected = {"/healthz": (200, b"ok"), "/nope": (404, b"no"), "/readyz": (200, b"re"), "/guard": (200, b"{\n")}
    assert [expected.get(p, (200, b"# ")) for p in paths] == got


# ------------------------------------------------------------------------------ credentials


@pytest.fixture(scope="module")
def slow_hash() -> str:
    """bcrypt at cost 10 (htpasswd -B's default, and node_exporter's example): about 70 ms a check."""
    return bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=10)).decode()


def serve_users(serve, tmp_path, hashed: str, **options):
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    options.setdefault("auth_failure_delay", 0.05)
    return serve(
        snapshot(),
        pod_labels={"pod": "", "namespace": "", "container": ""},
        web_config=WebConfigWatcher(str(path)),
        **options,
    )


def open_guesses(server, guesses: list, count: int = 32) -> None:
    """``count`` connections, each sending one random password for prometheus, appended to ``guesses``."""
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        token = base64.b64encode(f"prometheus:{secrets.token_hex(8)}".encode()).decode()
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
        guesses.append(sock)


def test_a_verified_user_is_answered_while_many_guesses_wait_for_bcrypt(serve, tmp_path, slow_hash):
    server = serve_users(serve, tmp_path, slow_hash, auth_workers=1, auth_rate=1000.0, auth_burst=1000.0)
    assert http_get(server, "/metrics", basic("prometheus", "s3cret"))[0] == 200  # verified once
    guesses = []
    try:
        open_guesses(server, guesses)
        assert wait_for(lambda: server.pending_verifications >= 16)
        status, _, body = http_get(server, "/metrics", basic("prometheus", "s3cret"), timeout=10)
        assert status == 200 and b"kvguard_guard_state" in body
        assert server.pending_verifications > 0  # answered ahead of the guesses still waiting
    finally:
        for sock in guesses:
            sock.close()


def test_unverified_credentials_past_the_per_source_limit_get_429(serve, tmp_path):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    server = serve_users(serve, tmp_path, hashed, auth_rate=0.001, auth_burst=2.0)
    statuses = [http_get(server, "/metrics", basic("prometheus", f"guess-{i}"))[0] for i in range(3)]
    assert statuses == [401, 401, 429]
    status, headers, _ = http_get(server, "/metrics", basic("prometheus", "guess-3"))
    assert status == 429 and headers["Retry-After"] == "1"


def test_the_per_source_limit_does_not_touch_verified_credentials(serve, tmp_path):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    server = serve_users(serve, tmp_path, hashed, auth_rate=0.001, auth_burst=2.0)
    assert http_get(server, "/metrics", basic("prometheus", "s3cret"))[0] == 200  # right: no token spent
    assert http_get(server, "/metrics", basic("prometheus", "guess"))[0] == 401
    assert http_get(server, "/metrics", basic("prometheus", "guess-2"))[0] == 401  # the last token
    assert http_get(server, "/metrics", basic("prometheus", "guess-3"))[0] == 429
    assert [http_get(server, "/metrics", basic("prometheus", "s3cret"))[0] for _ in range(5)] == [200] * 5


def test_right_first_logins_from_one_address_are_never_turned_away_for_their_number(serve, tmp_path):
    """Round three: 10 concurrent first logins from one address got 6 x 429. Only wrong passwords
    use up an address's guesses now."""
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    server = serve_users(serve, tmp_path, hashed, auth_rate=0.001, auth_burst=2.0)
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(http_get(server, "/metrics", basic("prometheus", "s3cret"))[0]))
        for _ in range(10)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert statuses == [200] * 10


def rotate(server, tmp_path, password: bytes, rounds: int = 4) -> None:
    """Write a new password hash into the server's web config and wait for its reload."""
    hashed = bcrypt.hashpw(password, bcrypt.gensalt(rounds=rounds)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    server.web_config.check_interval = 0.0
    server.web_config.current()
    server.web_config.wait()
    assert server.web_config.reloads_total == 1


def keep_alive_get(conn: http.client.HTTPConnection, password: str) -> int:
    conn.request("GET", "/metrics", headers=basic("prometheus", password))
    response = conn.getresponse()
    response.read()
    return response.status


def test_a_rotated_password_on_an_accepted_connection_is_not_refused_for_others_guesses(serve, tmp_path):
    """Round three: during a flood from the same address (a mesh proxy, SNAT), a Prometheus whose
    password was just rotated was refused (429): the address's guesses were used up by others."""
    hashed = bcrypt.hashpw(b"old", bcrypt.gensalt(rounds=4)).decode()
    server = serve_users(serve, tmp_path, hashed, auth_rate=0.001, auth_burst=2.0)
    prometheus = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        assert keep_alive_get(prometheus, "old") == 200
        guesses = [http_get(server, "/metrics", basic("prometheus", f"guess-{i}"))[0] for i in range(4)]
        assert guesses == [401, 401, 429, 429]  # the address has no guesses left
        rotate(server, tmp_path, b"new")
        assert keep_alive_get(prometheus, "new") == 200
        assert http_get(server, "/metrics", basic("prometheus", "guess-5"))[0] == 429
    finally:
        prometheus.close()


def test_a_rotated_password_on_an_accepted_connection_is_checked_ahead_of_waiting_guesses(serve, tmp_path, slow_hash):
    server = serve_users(serve, tmp_path, slow_hash, auth_workers=1, auth_rate=1000.0, auth_burst=1000.0)
    prometheus = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    guesses = []
    try:
        assert keep_alive_get(prometheus, "s3cret") == 200
        rotate(server, tmp_path, b"rotated", rounds=10)
        open_guesses(server, guesses)
        assert wait_for(lambda: server.pending_verifications >= 16)
        assert keep_alive_get(prometheus, "rotated") == 200
        assert server.pending_verifications > 8  # answered ahead of the guesses still waiting
    finally:
        prometheus.close()
        for sock in guesses:
            sock.close()


def test_a_wrong_password_refused_once_is_refused_again_without_a_token(serve, tmp_path):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    server = serve_users(serve, tmp_path, hashed, auth_rate=0.001, auth_burst=1.0)
    assert [http_get(server, "/metrics", basic("prometheus", "wrong"))[0] for _ in range(4)] == [401] * 4


def test_guesses_do_not_push_verified_credentials_out_of_the_cache():
    users = {"prometheus": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4))}
    auth = BasicAuth()
    assert auth.verify(users, "prometheus", "s3cret")
    for i in range(2 * BasicAuth.REFUSED_SIZE):
        assert not auth.verify(users, "prometheus", f"guess-{i}")
    assert auth.verified(users, "prometheus", "s3cret")


def test_a_changed_password_hash_is_not_served_from_the_cache():
    auth = BasicAuth()
    old = {"prometheus": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4))}
    assert auth.verify(old, "prometheus", "s3cret")
    new = {"prometheus": bcrypt.hashpw(b"other", bcrypt.gensalt(rounds=4))}
    assert not auth.verified(new, "prometheus", "s3cret")
    assert not auth.check(new, "prometheus", "s3cret")


def test_the_guess_limiter_refills_at_its_rate_per_source():
    now = [0.0]
    limiter = GuessLimiter(rate=2.0, burst=2.0, clock=lambda: now[0])
    assert [limiter.allow("10.0.0.1") for _ in range(3)] == [True, True, False]
    assert limiter.allow("10.0.0.2")  # another address has its own bucket
    now[0] += 0.5  # one token back at 2 a second
    assert [limiter.allow("10.0.0.1") for _ in range(2)] == [True, False]


def test_the_guess_limiter_tracks_a_bounded_number_of_sources():
    limiter = GuessLimiter(rate=1.0, burst=1.0, max_sources=16, clock=lambda: 0.0)
    for i in range(1000):
        limiter.allow(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter._buckets) == 16
