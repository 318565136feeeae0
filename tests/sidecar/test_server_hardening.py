"""The sidecar's HTTP server under hostile peers, on loopback: memory and threads stay bounded,
a normal scrape still gets through, and nothing a peer sends takes /metrics down."""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from typing import Callable

import pytest
from helpers import wait_for
from sidecar_fixtures import http_get, snapshot, write

from kvguard.sidecar.server import BadRequest, KVGuardServer, parse_request


def scrape(server: KVGuardServer, path: str = "/metrics", timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    return b"".join(chunks)


def test_a_request_head_over_the_byte_cap_is_refused_with_431(serve):
    server = serve(snapshot(), max_header_bytes=16 * 1024)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(10):  # 98 headers of 65 KB is what the flood sent; 10 are enough to cross the cap
                sock.sendall(b"X-Flood: " + b"a" * 65000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_more_header_lines_than_the_cap_is_refused_with_431(serve):
    server = serve(snapshot(), max_headers=20)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(21)) + b"\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 431 ")


def test_a_normal_scrape_answers_while_forty_flooding_connections_stall(serve):
    server = serve(snapshot())
    flooders = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Flood: " + b"a" * 20000)  # and then stall
            flooders.append(sock)
        assert wait_for(lambda: server.open_connections >= 40)
        status, body = scrape(server)
        assert status == 200 and b"kvguard_guard_state" in body
    finally:
        for sock in flooders:
            sock.close()


def test_a_header_flood_under_basic_auth_is_refused_at_the_cap_before_auth(serve):
    """With auth on, the flood still sends no credentials: the cap must hold before auth is looked at."""
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    answers = []
    for _ in range(20):  # 20 connections reached 152 MB under auth
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            try:
                for _ in range(10):
                    sock.sendall(b"X-Flood: " + b"a" * 65000 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            answers.append(read_all(sock)[:12])
    assert answers == [b"HTTP/1.1 431"] * 20
    assert scrape(server)[0] == 401


def test_open_connections_start_no_threads(serve):
    """One thread per connection was the slowloris' lever: 2,000 idle connections held 70 MB."""
    server = serve(snapshot())
    assert scrape(server)[0] == 200  # the first spool read is done: its thread is gone
    before = threading.active_count()
    idle = []
    try:
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            idle.append(sock)
        assert scrape(server)[0] == 200  # accepted after the 100: they are all open by now
        assert threading.active_count() <= before
    finally:
        for sock in idle:
            sock.close()


def test_slowloris_connections_past_the_cap_make_room_for_a_scrape(serve):
    server = serve(snapshot(), max_connections=16)
    stalled = []
    try:
        for _ in range(40):  # each sends a partial request head and never finishes it
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            stalled.append(sock)
        assert wait_for(lambda: server.connections_evicted_total >= 24)
        assert server.open_connections <= 16
        assert scrape(server)[0] == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_head_that_never_finishes_is_closed_after_the_header_timeout(serve):
    server = serve(header_timeout=0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("line", [b"GET /\r\n", b"GET /metrics\n", b"\r\nGET /healthz\r\n", b"GET / FTP/1.0\r\n"])
def test_an_http_0_9_request_line_is_answered_400_at_once(serve, line):
    """Round three: "GET /" waited the header timeout for a 408; Go answers 400 at once. The head
    timeout here is 60 s and the client gives up after 10, so only an answer at once passes."""
    server = serve(header_timeout=60)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(line)
        assert read_all(sock).startswith(b"HTTP/1.1 400 ")


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(serve):
    server = serve(request_timeout=0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ") and b"Connection: keep-alive" in first
        assert read_all(sock) == b""  # closed by the server, without a second answer


def test_a_405_closes_the_connection_so_its_body_is_never_read_as_a_request(serve):
    server = serve(snapshot())
    smuggled = b"GET /guard HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 405 ")
    assert answer.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in answer


def test_keep_alive_serves_pipelined_requests_in_order(serve):
    server = serve(snapshot())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        answer = read_all(sock)
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert answer.index(b"ok\n") < answer.index(b"ready\n")


def test_every_connection_has_tcp_nodelay(serve):
    server = serve(snapshot())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(65536)
        (conn,) = list(server._conns.values())
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_parallel_scrapes_share_one_render_per_refresh(serve):
    server = serve(snapshot(rank=0, pid=10), snapshot(rank=1, device="npu:1", pid=11))
    results = []
    threads = [threading.Thread(target=lambda: results.append(scrape(server))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [status for status, _ in results] == [200] * 8
    assert len({body for _, body in results}) == 1
    assert server.exposition.renders_total == 1


def test_a_lone_surrogate_in_a_snapshot_label_does_not_take_metrics_down(serve, tmp_path):
    good = snapshot(rank=0, pid=10)
    bad = snapshot(
        rank=1, device="npu:\udcff", pid=11, pod={"pod": "vllm-\udcfe", "namespace": "llm", "container": "vllm"}
    )
    spool = tmp_path / "spool"
    spool.mkdir()
    write(spool, good)
    import json

    payload = json.dumps(bad.to_dict())  # json escapes the surrogates as \udcff: what a probe could write
    (spool / "node-7-11-npu__.json").write_text(payload)
    server = serve()
    status, body = scrape(server)
    assert status == 200
    assert 'device="npu:\ufffd"'.encode() in body
    assert b'device="npu:0"' in body


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
        (b"GET /metrics\r\n\r\n", 400),
        (b"get /metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\n folded: header\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nBad Header: x\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    ],
)
def test_malformed_request_heads_get_a_4xx_or_505(head, status):
    with pytest.raises(BadRequest) as raised:
        parse_request(head)
    assert raised.value.status == status


def test_http_1_0_closes_unless_it_asks_for_keep_alive():
    assert not parse_request(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse_request(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").keep_alive
    assert parse_request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").keep_alive
    assert not parse_request(b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n").keep_alive


# ------------------------------------------------------------------ issue 23's small ones


def test_a_content_length_of_digits_outside_ascii_is_a_400():
    """'²' is a digit to str.isdigit() and not to int(): a ValueError left the peer without an answer."""
    with pytest.raises(BadRequest) as raised:
        parse_request("GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"))
    assert raised.value.status == 400


def test_the_server_answers_a_content_length_of_a_superscript_two_with_400(serve):
    server = serve()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall("GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"))
        assert read_all(sock).startswith(b"HTTP/1.1 400 ")


def test_http_1_1_without_host_is_a_400():
    """RFC 9112 3.2: a server MUST respond with 400 to an HTTP/1.1 request that lacks a Host field."""
    with pytest.raises(BadRequest) as raised:
        parse_request(b"GET /metrics HTTP/1.1\r\nAccept: */*\r\n\r\n")
    assert raised.value.status == 400 and "Host" in str(raised.value)


def test_http_1_0_without_host_is_served():
    assert parse_request(b"GET /metrics HTTP/1.0\r\n\r\n").path == "/metrics"


def test_the_asterisk_target_is_a_400_for_get():
    """'*' is only OPTIONS' target (RFC 9112 3.2.4); node_exporter and nginx answer GET * with 400."""
    with pytest.raises(BadRequest) as raised:
        parse_request(b"GET * HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raised.value.status == 400


def test_a_higher_http_1_minor_version_is_served_as_http_1_1():
    """RFC 9110 6.2: a server should send a response for the highest minor version it supports."""
    request = parse_request(b"GET /metrics HTTP/1.2\r\nHost: x\r\n\r\n")
    assert request.version == "HTTP/1.1" and request.keep_alive


def test_a_431_is_followed_by_a_lingering_close_not_a_reset(serve):
    """The server shuts its side, reads and drops what the peer still sends, then closes: the
    peer reads the whole 431 and an orderly end, never a reset that can discard the answer."""
    server = serve(max_header_bytes=4096)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sender_error = []

        def send_head():  # a head far over the cap, still being sent when the server answers
            try:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Flood: " + b"a" * 256 * 1024)
            except OSError as exc:
                sender_error.append(exc)

        sender = threading.Thread(target=send_head)
        sender.start()
        chunks = []
        while chunk := sock.recv(65536):  # a reset raises ConnectionResetError here
            chunks.append(chunk)
        sender.join()
    assert b"".join(chunks).startswith(b"HTTP/1.1 431 ")
    assert sender_error == []


# ------------------------------------------------------------------ issue 37 item 3: guesses by address


def users_server(serve, tmp_path, **options) -> KVGuardServer:
    """A server whose one user, prometheus, has the password s3cret (bcrypt cost 4)."""
    import bcrypt

    from kvguard.sidecar.webconfig import WebConfigWatcher

    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(b's3cret', bcrypt.gensalt(rounds=4)).decode()}\n")
    options.setdefault("auth_failure_delay", 0.05)
    return serve(
        snapshot(),
        pod_labels={"pod": "", "namespace": "", "container": ""},
        web_config=WebConfigWatcher(str(path)),
        **options,
    )


def hold_guesses(server: KVGuardServer) -> threading.Event:
    """bcrypt runs for passwords starting with "guess" wait until the returned event is set, so
    that every guess sent is in the server's hands before any is refused."""
    release = threading.Event()
    real = server.app.basic_auth.verify

    def verify(users, user, password):
        if password.startswith("guess"):
            release.wait(30)
        return real(users, user, password)

    server.app.basic_auth.verify = verify
    return release


def auth_request(password: str) -> bytes:
    import base64

    token = base64.b64encode(f"prometheus:{password}".encode()).decode()
    return f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode()


def open_from(server: KVGuardServer, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=(source, 0))


def status_of(sock: socket.socket) -> int:
    """The status of the next answer on a keep-alive connection, its body read (Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data[:100]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"\r\nContent-Length: *([0-9]+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    assert len(body) == length  # nothing of a next answer: one request out at a time
    return int(head.split(b" ", 2)[1])


def test_one_address_with_many_connections_cannot_lock_out_another_addresss_new_login(serve, tmp_path):
    """Review of issue 37: the limiter was only looked at, not taken from, until bcrypt refused; one
    address with many connections filled the 64-place bcrypt queue (8 here) and every other
    address's new valid credential got 429. Now an address holds at most auth_queue_per_source
    places (and its tokens); the rest of its credentials wait outside the queue."""
    server = users_server(serve, tmp_path, auth_workers=1, auth_queue=8, auth_rate=0.001, auth_burst=4.0)
    release = hold_guesses(server)
    guessers = [open_from(server, "127.0.0.2") for _ in range(16)]
    statuses: list[int] = []
    try:
        for i, sock in enumerate(guessers):
            sock.sendall(auth_request(f"guess-{i}"))
        assert wait_for(lambda: server.pending_verifications + server.rejected_total >= 16)
        login = threading.Thread(
            target=lambda: statuses.append(
                http_get(server, "/metrics", {"Authorization": "Basic " + base64_token("s3cret")})[0]
            )
        )
        login.start()
        assert wait_for(lambda: server.pending_verifications + server.rejected_total >= 17)
        release.set()
        login.join(30)
        assert statuses == [200]  # was 429: the guesses had every place in the queue
        guesses = sorted(status_of(sock) for sock in guessers)
        assert guesses == [401] * 4 + [429] * 12  # the guesser's 4 tokens, whatever its connections
    finally:
        release.set()
        for sock in guessers:
            sock.close()


def test_an_addresss_concurrent_guesses_are_bounded_by_its_tokens_not_by_bcrypt(serve, tmp_path):
    """Review of issue 37: every guess on another connection passed the limiter until the first
    bcrypt refusal was charged: 16 connections got 16 bcrypt runs from a burst of 4. (16 new
    connections, each with a first credential that is wrong, use up the first-login budget of
    their address too: what cannot be told apart from a first login before bcrypt is paid as one.)"""
    server = users_server(serve, tmp_path, auth_rate=0.001, auth_burst=4.0)
    release = hold_guesses(server)
    guessers = [open_from(server, "127.0.0.1") for _ in range(16)]
    try:
        for i, sock in enumerate(guessers):
            sock.sendall(auth_request(f"guess-{i}"))
        assert wait_for(lambda: server.pending_verifications + server.rejected_total >= 16)
        release.set()
        assert sorted(status_of(sock) for sock in guessers) == [401] * 4 + [429] * 12
        # a right first login from that address, its tokens gone: refused, as any unverified credential
        assert http_get(server, "/metrics", {"Authorization": "Basic " + base64_token("s3cret")})[0] == 429
    finally:
        release.set()
        for sock in guessers:
            sock.close()


def base64_token(password: str) -> str:
    import base64

    return base64.b64encode(f"prometheus:{password}".encode()).decode()


def keep_alive(server: KVGuardServer) -> tuple[http.client.HTTPConnection, Callable[[str], int]]:
    """One keep-alive connection (Prometheus') and a function that scrapes /metrics on it with a password."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)

    def get(password: str) -> int:
        conn.request("GET", "/metrics", headers={"Authorization": "Basic " + base64_token(password)})
        response = conn.getresponse()
        response.read()
        return response.status

    return conn, get


def test_two_different_wrong_passwords_end_a_connections_trust(serve, tmp_path):
    """Review of issue 37: a connection that had one credential accepted skipped the limiter with
    any later credential, for ever: a keep-alive connection could guess without limit. One
    refusal keeps its kind (a rotation always costs one); after a second different one, its
    credentials are GUESSes, paid from its address's guess tokens."""
    server = users_server(serve, tmp_path, auth_rate=0.001, auth_burst=3.0)
    prometheus, keep_alive_get = keep_alive(server)
    try:
        assert keep_alive_get("s3cret") == 200  # trusted from now
        with open_from(server, "127.0.0.1") as guesser:
            # first logins 3 - 2 = 1 left; guesses 3 - 2 (paid by the first logins) - 1 = 0 left
            assert keep_alive_guesses(guesser, 3) == [401, 401, 401]
        assert keep_alive_get("wrong-1") == 401  # trusted: FRONT, checked all the same
        assert keep_alive_get("wrong-2") == 401  # one refusal demotes nothing: FRONT
        assert keep_alive_get("wrong-3") == 429  # a GUESS now, none left (FRONT, FRESH: 1 each)
        assert keep_alive_get("s3cret") == 200  # the right one, cached, always
    finally:
        prometheus.close()


def test_a_rotated_password_on_a_keep_alive_connection_is_accepted_beside_a_flood_of_guesses(serve, tmp_path):
    """Review: a rotation always costs the old password one 401 on Prometheus' keep-alive
    connection; that 401 made the new password a GUESS, served last and paid from the guess
    tokens that another client behind the same address (SNAT) had used up: 429, 429, while a new
    connection got 200. One refusal now demotes nothing: the new password goes to the front."""
    import bcrypt

    server = users_server(serve, tmp_path, auth_workers=2, auth_rate=0.001, auth_burst=2.0)
    prometheus, keep_alive_get = keep_alive(server)
    stop = threading.Event()
    flooded: list[int] = []

    def flood() -> None:
        with open_from(server, "127.0.0.1") as sock:
            while not stop.is_set():
                flooded.extend(keep_alive_guesses(sock, 1))

    flooder = threading.Thread(target=flood)
    try:
        assert keep_alive_get("s3cret") == 200
        flooder.start()
        assert wait_for(lambda: 429 in flooded)  # the address's guesses are used up
        before = server.web_config.current().basic_auth_users
        (tmp_path / "web.yml").write_text(
            f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(b'n3w', bcrypt.gensalt(rounds=4)).decode()}\n"
        )
        assert wait_for(lambda: server.web_config.current().basic_auth_users != before)
        assert keep_alive_get("s3cret") == 401  # Prometheus has not re-read its file yet
        assert keep_alive_get("s3cret") == 401  # nor now (from the cache of refusals)
        # Answered, not refused (was 429); how long it waits under the flood is bench/bench_credentials.py's figure.
        assert keep_alive_get("n3w") == 200
        assert keep_alive_get("n3w") == 200
    finally:
        stop.set()
        flooder.join(30)
        prometheus.close()


def test_trusted_connections_of_one_address_have_one_place_at_the_front_and_pay_for_their_guesses(serve, tmp_path):
    """Review of issue 37: every connection that had had a credential accepted went to the front of
    the bcrypt queue with any later one: many of them starved everyone else, unlimited. Now one
    place at the front per address, the others admitted as any unverified credential."""
    server = users_server(serve, tmp_path, auth_workers=2, auth_rate=0.001, auth_burst=2.0)
    conns = [open_from(server, "127.0.0.1") for _ in range(6)]
    try:
        for sock in conns:
            sock.sendall(auth_request("s3cret"))
            assert status_of(sock) == 200
        assert all(conn.trusted for conn in server._conns.values())
        release = hold_guesses(server)
        for i, sock in enumerate(conns):
            sock.sendall(auth_request(f"guess-{i}"))
        assert wait_for(lambda: server.pending_verifications + server.rejected_total >= 6)
        release.set()
        # one at the front (its own budget), two on the address's tokens; the rest refused
        assert sorted(status_of(sock) for sock in conns) == [401] * 3 + [429] * 3
    finally:
        for sock in conns:
            sock.close()


_GUESS_NUMBER = iter(range(1 << 30))


def keep_alive_guesses(sock: socket.socket, count: int) -> list[int]:
    """``count`` wrong passwords never sent before, one after the other on ``sock``: their statuses."""
    statuses = []
    for _ in range(count):
        sock.sendall(auth_request(f"wrong-{next(_GUESS_NUMBER)}"))
        statuses.append(status_of(sock))
    return statuses


def test_a_first_login_from_the_address_of_a_keep_alive_flood_is_not_refused(serve, tmp_path):
    """Issue 37, item 3: guesses repeated on keep-alive connections used up their address's tokens,
    and a right first login from that address (Prometheus behind the attacker's SNAT or mesh proxy)
    got 429. A connection's credentials after two different ones are refused are GUESSes, on a
    budget of their own: the first login's budget is used up only by the first two credentials of
    each connection."""
    server = users_server(serve, tmp_path, auth_rate=0.001, auth_burst=6.0)
    guessers = [open_from(server, "127.0.0.1") for _ in range(2)]
    try:
        flood = [keep_alive_guesses(sock, 8) for sock in guessers]
        # the address's 6 guess tokens; each connection's first two credentials are paid as first
        # logins too (6 tokens of their own: 2 left after the second connection's), in debt to the guesses
        assert flood == [[401] * 6 + [429] * 2, [401] * 2 + [429] * 6]
        assert http_get(server, "/metrics", {"Authorization": "Basic " + base64_token("s3cret")})[0] == 200  # was 429
        assert keep_alive_guesses(guessers[0], 2) == [429, 429]  # and the flood still pays
    finally:
        for sock in guessers:
            sock.close()


def test_guesses_turned_away_unchecked_do_not_keep_a_connection_a_first_login(serve, tmp_path):
    """Issue 37, item 3, found on a quiet machine (bench/bench_credentials.py: 7 of 11 first logins from a
    keep-alive flood's address got 429): a 429 changed no kind, so a flood's connections whose first
    guesses were all turned away stayed first logins, and took every first-login token their address got
    back. Two different credentials turned away (or refused) now make the next one a GUESS, as two
    refusals did; the same one retried after a 429 stays what it was."""
    server = users_server(serve, tmp_path, auth_rate=0.5, auth_burst=2.0)
    with open_from(server, "127.0.0.1") as first, open_from(server, "127.0.0.1") as flood:
        assert keep_alive_guesses(first, 2) == [401, 401]  # the address's two first-login tokens
        assert keep_alive_guesses(flood, 3) == [429] * 3  # none left: turned away, none checked
        time.sleep(2.2)  # one first-login token back (one every 2 s)
        keep_alive_guesses(flood, 2)  # GUESSes now: paid from the guess tokens (was: the first logins')
        assert http_get(server, "/metrics", {"Authorization": "Basic " + base64_token("s3cret")})[0] == 200


def test_one_wrong_password_turned_away_then_refused_is_one_and_demotes_nothing(serve, tmp_path, monkeypatch):
    """Review: a wrong password answered 429, then 401 when retried, was counted twice (once turned away, once
    refused), so the right password after it was a GUESS: the rotation case one refusal must not demote."""
    import kvguard.sidecar.server as server_module

    kinds: list[bool] = []
    guessing = server_module._Conn.guessing
    monkeypatch.setattr(
        server_module._Conn, "guessing", lambda conn, key: kinds.append(guessing(conn, key)) or kinds[-1]
    )
    server = users_server(serve, tmp_path, auth_rate=0.5, auth_burst=2.0)
    with open_from(server, "127.0.0.1") as other, open_from(server, "127.0.0.1") as user:
        assert keep_alive_guesses(other, 2) == [401, 401]  # the address's two first-login tokens
        user.sendall(auth_request("old-password"))
        assert status_of(user) == 429  # turned away: none left
        time.sleep(2.2)  # one back
        user.sendall(auth_request("old-password"))
        assert status_of(user) == 401  # the same one, checked now
        user.sendall(auth_request("s3cret"))
        assert status_of(user) in (200, 429)  # 429 only if its first-login token is not back yet
    assert kinds[-1] is False  # the right password after one wrong one: a first login, not a GUESS


def test_a_first_login_waits_for_no_guess_in_bcrypts_hands(serve, tmp_path):
    """The bound on a first login's wait: the bcrypt run in progress on the verifier kept for first
    logins and rotated passwords (none here), then its own; never the guesses queued or running."""
    server = users_server(serve, tmp_path, auth_workers=2, auth_rate=0.001, auth_burst=16.0)
    guessers = [open_from(server, "127.0.0.1") for _ in range(4)]
    release = hold_guesses(server)
    try:
        for sock in guessers:
            assert keep_alive_guesses(sock, 2) == [401, 401]  # two refused: their next credentials are GUESSes
            sock.sendall(auth_request("guess-held"))  # held in bcrypt until released
        assert wait_for(lambda: server.pending_verifications >= 4)
        assert http_get(server, "/metrics", {"Authorization": "Basic " + base64_token("s3cret")})[0] == 200
        assert not release.is_set()  # answered while every guess is still held in bcrypt: it waited on none of them
    finally:
        release.set()
        for sock in guessers:
            sock.close()


def test_a_repeated_wrong_password_is_answered_from_the_cache_and_uses_no_token(serve, tmp_path):
    """A client repeating one wrong password (an old replica's) costs one bcrypt run and one token,
    not one per request: the address's guesses and first logins stay for others."""
    server = users_server(serve, tmp_path, auth_rate=0.001, auth_burst=2.0)
    calls = []
    real = server.app.basic_auth.verify
    server.app.basic_auth.verify = lambda *args: calls.append(args) or real(*args)
    with open_from(server, "127.0.0.1") as sock:
        for _ in range(10):
            sock.sendall(auth_request("old-password"))
            assert status_of(sock) == 401
    assert len(calls) == 1
    assert http_get(server, "/metrics", {"Authorization": "Basic " + base64_token("s3cret")})[0] == 200
