"""The sidecar's HTTP endpoints: /metrics, /healthz, /readyz, /guard, the runbook at /runbook and
/runbook/<alertname>, a landing page at /; 404 for anything else.

The peer is untrusted (``/metrics`` listens on 0.0.0.0 in a pod with a 256 MiB limit), so memory
and threads are bounded whatever it sends:

- one selector thread reads every connection's request head without blocking (TLS handshakes
  included), into a buffer of at most ``max_header_bytes``; a head over that, or with more than
  ``max_headers`` lines, is answered 431 and closed;
- at most ``max_connections`` connections are open; at the cap, the one that has waited longest
  without sending a complete request is closed to make room, so slow or idle clients cannot
  lock a scrape out;
- a head must arrive within ``header_timeout`` seconds of its first byte, and an idle keep-alive
  connection is closed after ``idle_timeout``;
- the same thread answers what is cheap (``/healthz``, ``/readyz`` and ``/metrics`` once made for
  this refresh, errors, 401, 429, the landing page, the runbook) and writes every answer without
  blocking: each connection keeps its unsent output (the shared chunks, not copies) and is not read
  while that is over ``output_limit``, until it drains; output unsent ``request_timeout`` seconds after it
  was queued closes the connection. A peer that never reads holds its own connection, nothing else;
- what is not cheap (a /metrics or /guard build, /readyz after a refresh) goes to a pool of
  ``workers`` threads, /readyz first; pipelined requests are taken one at a time per connection,
  so at most one request per connection is queued and nothing is refused for being busy (no 503);
- basic-auth credentials already verified are checked in the loop in constant time, and those
  bcrypt has already refused are answered 401 from a bounded cache (kvguard.sidecar.webconfig.BasicAuth),
  using up no token; others go to a pool of ``auth_workers`` bcrypt threads of their own.
  The cost of wrong guesses falls on the guessers: each credential handed to bcrypt takes one of
  its source address's tokens (``auth_rate`` a second, ``auth_burst`` at once), given back when
  bcrypt accepts it, so only refused passwords use them up and an address never has more
  credentials in bcrypt's hands than tokens, whatever its number of connections. At most
  ``auth_queue_per_source`` of an address's credentials are in the queue (``auth_queue`` of a kind in all,
  429 beyond); the rest wait outside it for their address's turn, not refused for their number,
  and are refused (429) once the address has neither tokens nor credentials out. So one address
  cannot fill the queue and lock out others' new logins (_AuthGate).
  Credentials come in three kinds, by what their connection has shown, each with tokens of its own
  per address: GUESS, one that has had two different credentials refused (401) or turned away
  unchecked (429) since one was accepted, or that presents the refused one again; else FRONT, one
  that has had a credential accepted (Prometheus' keep-alive connection, its password just rotated:
  one per address at the front of the queue); else FRESH (a first login). One refusal demotes
  nothing, because a rotation always costs one: the old password is refused (as often as it is
  repeated, from the cache) on the connection that then sends the new one, which keeps the kind its
  connection had; a 429 checks no credential, and the same credential retried after it keeps its
  kind. bcrypt takes FRONT, then FRESH, then GUESS, and with two threads or more one is kept for
  the first two. So guesses repeated on keep-alive connections, from any address (a mesh proxy or
  SNAT puts Prometheus behind the attacker's), never refuse or delay a first login beyond the first
  two of each connection: it waits only for
  the FRONT and FRESH credentials queued ahead of it (none from a connection past its second
  refused guess; at most one and ``auth_queue_per_source`` per address, within their tokens) and
  for the bcrypt run in progress on the kept thread (with one thread, on it), then for its own.
  A FRESH credential refused is paid from both budgets (the GUESS one into debt), so an
  address's wrong guesses still never outrun ``auth_rate`` beyond two bursts (a connection that
  has had a credential accepted pays its first two from the FRONT tokens while it has them). What no server can
  tell apart before bcrypt: an attacker opening a new connection for every two guesses (at
  ``auth_rate`` a second or more) from the first login's address uses up the FRESH budget too,
  and the first login then waits for it or gets 429, as on every other budget;
  a wrong password and a 429 are answered ``auth_failure_delay`` seconds late, the connection not
  read meanwhile, so a flood of guesses on keep-alive connections makes one a second on each;
- new connections are accepted (and their first request answered) between every ``ACCEPT_EVERY``
  busy ones, so a probe or a scrape does not wait for a round of keep-alive clients;
- a request with a body (``405``, or a GET with Content-Length / Transfer-Encoding) is answered
  and the connection closed, so a body is never read as the next request;
- a connection the server ends after an answer (an error, ``Connection: close``) is closed
  lingering, as Apache and Go do: writes shut down, what the peer still sends read and dropped
  for at most ``LINGER_SECONDS`` / ``LINGER_BYTES``, then closed, so unread input does not turn
  the close into a reset that can destroy the answer (a 431) before the peer reads it;
- plain HTTP sent to the TLS port is answered 400 with a sentence, in plain text, as Go's
  net/http answers it;
- TCP_NODELAY on every connection, so a keep-alive scrape does not wait on Nagle / delayed ACK.

/metrics and /guard are made once per sidecar refresh (kvguard.sidecar.exposition), whatever the scrape rate
(the /metrics formats scraped during one refresh are built ahead for the next, in a worker):
parallel scrapes share one observation, one collection, each format and its gzip; a large body is
sent from the shared chunks, never joined or copied per scrape.

TLS and basic auth come from ``--web.config.file`` (exporter-toolkit format, kvguard.sidecar.webconfig,
re-read on change) or the shorthand flags; the probes (/healthz, /readyz) stay open so the
kubelet can reach them without credentials.
"""

from __future__ import annotations

import base64
import functools
import heapq
import hmac
import html
import importlib.resources
import itertools
import queue
import re
import selectors
import socket
import ssl
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, cast
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import gzip_accepted  # exposition.py 0.17.0:251-256, 0.26.0:429-434

from kvguard.sidecar.core import Sidecar
from kvguard.sidecar.exposition import Exposition
from kvguard.sidecar.webconfig import BasicAuth, GuessLimiter, WebConfig, WebConfigWatcher
from kvguard.text import one_line

OPEN_PATHS = ("/healthz", "/readyz")
LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn (4096 on current kernels)
ACCEPTS_PER_WAKEUP = 256
SWEEP_SECONDS = 0.05  # timeouts and held answers are looked at this often
ACCEPT_EVERY = 16  # busy connections served between two looks at the listener
# Apache's lingering close waits 2 s per read (SECONDS_TO_LINGER), 30 s in all; here 2 s in all,
# and at most LINGER_BYTES dropped, so a peer cannot hold a lingering connection busy.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20
# Go's net/http answer to a TLS record header that looks like HTTP (server.go, (*conn).serve,
# tlsRecordHeaderLooksLikeHTTP), written on the raw connection.
PLAIN_HTTP_ON_TLS = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
# OpenSSL's reasons for a handshake whose first bytes are an HTTP request (ssl/record/ssl3_record.c).
_PLAIN_HTTP_REASONS = ("HTTP_REQUEST", "HTTPS_PROXY_REQUEST")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    414: "URI Too Long",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


@dataclass(frozen=True)
class ServerOptions:
    listen: str = "0.0.0.0"
    port: int = 10240
    fail_readiness_on_critical: bool = False
    runbook_public: bool = False  # /runbook and /runbook/<alert> answer without basic auth
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    basic_auth_user: str | None = None
    basic_auth_password: str | None = None
    web_config_file: str | None = None
    web_config_allow_auth_off: bool = False  # a reload of web_config_file may switch basic auth off
    request_timeout: float = 30.0  # writing a response; also the idle keep-alive limit
    header_timeout: float = 10.0  # from a request's first byte to the end of its head
    max_header_bytes: int = 32 * 1024  # request line and headers together
    max_headers: int = 100
    max_connections: int = 1024
    workers: int = 4  # build /metrics and /guard; the event loop sends
    output_limit: int = 256 * 1024  # unsent bytes past which a connection is not read until it drains
    # bcrypt runs for credentials not verified yet (~70 ms each at cost 10); of two or more, one is kept
    # for rotated passwords and first logins, never a guess's (kvguard.sidecar.server's docstring)
    auth_workers: int = 2
    auth_queue: int = 64  # first logins, and guesses, waiting for bcrypt (each); beyond, 429
    auth_rate: float = 1.0  # refused guesses per second, source address and kind (429 beyond)
    auth_burst: float = 4.0
    # credentials of one source address queued for or in bcrypt at once (the rest of its wait apart,
    # outside the queue), so that one address cannot fill ``auth_queue``; at most its tokens, too
    auth_queue_per_source: int = 4
    auth_failure_delay: float = 1.0  # a wrong password or a 429 answered this late (the connection not read)


def make_tls_context(options: ServerOptions) -> ssl.SSLContext | None:
    """The flags' TLS context, or None without TLS. Raises OSError or ssl.SSLError on a bad cert or key."""
    if not options.tls_cert_file:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(options.tls_cert_file, options.tls_key_file)
    return context


# ------------------------------------------------------------------------------ request parsing


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    version: str
    headers: Mapping[str, str]  # lower-case names
    keep_alive: bool
    has_body: bool

    @property
    def path(self) -> str:
        return urlsplit(self.target).path if not self.target.startswith("/") else self.target.split("?", 1)[0]


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_METHOD = re.compile(r"[A-Z]{1,16}\Z")
_SINGLE = ("host", "authorization", "content-length")
_VERSION = re.compile(r"HTTP/([0-9])\.([0-9])\Z")
_DIGITS = re.compile(r"[0-9]{1,18}\Z")
MAX_TARGET = 8 * 1024


def _request_line_ok(buffer: bytes | bytearray) -> bool:
    """False when the buffer's first complete line (after empty ones) is not METHOD SP TARGET SP VERSION."""
    start = 0
    while True:
        newline = buffer.find(b"\n", start)
        if newline < 0:
            return True
        line = bytes(buffer[start:newline]).rstrip(b"\r")
        if line:
            return line.count(b" ") == 2 and line.rsplit(b" ", 1)[1].startswith(b"HTTP/")
        start = newline + 1


def find_head_end(buffer: bytes | bytearray) -> int:
    """Index just past the blank line ending a request head, or -1 (CRLF, or bare LF as RFC 9112 allows)."""
    crlf = buffer.find(b"\r\n\r\n")
    lf = buffer.find(b"\n\n")
    ends = [i + 4 for i in (crlf,) if i >= 0] + [i + 2 for i in (lf,) if i >= 0]
    return min(ends) if ends else -1


def parse_request(head: bytes, max_headers: int = 100) -> Request:
    """One request head (through its blank line). Raises BadRequest(status, message)."""
    text = head.decode("latin-1")
    lines = text.split("\n")
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    while lines and lines[-1] == "":
        lines.pop()
    while lines and lines[0] == "":  # RFC 9112 2.2: ignore empty lines before the request line
        lines.pop(0)
    if not lines:
        raise BadRequest(400, "empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if not _METHOD.match(method):
        raise BadRequest(400, "malformed method")
    if len(target) > MAX_TARGET:
        raise BadRequest(414, "request target too long")
    if (
        not target
        or any(ord(c) <= 32 or ord(c) >= 127 for c in target)
        or not (target.startswith("/") or target == "*" or target.startswith(("http://", "https://")))
    ):
        raise BadRequest(400, "malformed request target")
    if target == "*" and method != "OPTIONS":  # RFC 9112 3.2.4: the asterisk form is OPTIONS' only
        raise BadRequest(400, "the request target * is only for OPTIONS")
    numbers = _VERSION.match(version)
    if numbers is None:
        raise BadRequest(400, "malformed HTTP version")
    if numbers.group(1) != "1":
        raise BadRequest(505, "HTTP version not supported")
    # RFC 9110 6.2: a later HTTP/1.x is answered as the highest 1.x the server speaks, 1.1.
    version = "HTTP/1.0" if numbers.group(2) == "0" else "HTTP/1.1"
    if len(lines) - 1 > max_headers:
        raise BadRequest(431, f"more than {max_headers} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise BadRequest(400, "obsolete header line folding")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name):
            raise BadRequest(400, "malformed header line")
        name, value = name.lower(), value.strip(" \t")
        if any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in value):
            raise BadRequest(400, "control character in a header value")
        if name in headers:
            if name in _SINGLE:
                raise BadRequest(400, f"repeated {name} header")
            headers[name] += ", " + value
        else:
            headers[name] = value
    if version == "HTTP/1.1" and "host" not in headers:  # RFC 9112 3.2: MUST answer 400
        raise BadRequest(400, "an HTTP/1.1 request needs a Host header")
    connection = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    has_body = "transfer-encoding" in headers
    if "content-length" in headers:
        length = headers["content-length"]
        if not _DIGITS.match(length):  # ASCII digits only: str.isdigit() is true for "²", int() refuses it
            raise BadRequest(400, "malformed Content-Length")
        has_body = has_body or int(length) > 0
    return Request(method, target, version, headers, keep_alive and not has_body, has_body)


# ------------------------------------------------------------------------------ responses


@dataclass
class Response:
    status: int
    body: bytes | tuple[bytes, ...]  # or chunks sent in order (the cached /metrics, never joined)
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False
    delay: float = 0.0  # seconds to hold the answer back (a wrong password, a 429)

    @property
    def chunks(self) -> tuple[bytes, ...]:
        return (self.body,) if isinstance(self.body, bytes) else self.body

    @property
    def length(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)


def _text(status: int, text: str, **kw: Any) -> Response:
    return Response(status, text.encode("utf-8", "replace"), **kw)


def encode_head(response: Response, keep_alive: bool, extra: Mapping[str, str]) -> bytes:
    lines = [
        f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}",
        "Server: kvguard",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {response.length}",
    ]
    lines += [f"{k}: {v}" for k, v in {**extra, **response.headers}.items()]
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


# Over TLS, writes up to this size are joined into one send (with TCP_NODELAY, each send is a
# segment); larger chunks (a big spool's exposition, shared by every scrape of a refresh) go out
# as they are, never copied per scrape. Plain TCP gathers them in one sendmsg instead.
COALESCE_BYTES = 64 * 1024
# Plain TCP: up to this many pieces, or bytes, in one sendmsg (scatter-gather; IOV_MAX is 1024).
GATHER_PIECES, GATHER_BYTES = 256, 4 << 20
# What the event loop does for one connection before it turns to the others (pipelined requests).
REQUESTS_PER_TURN = 16

# What the event loop hands on to a worker (bcrypt first is a Verify).
BUILD = "build"
# Worker queue priorities: /readyz before everything else, then the rest in arrival order, then
# building ahead for the next refresh.
_PROBE, _SCRAPE, _AHEAD = 0, 1, 2
# Formats (Accept, gzip) remembered for building ahead: the few a deployment's scrapers ask for.
AHEAD_FORMATS = 4


@dataclass(frozen=True)
class Verify:
    """Credentials bcrypt has to check before the request is built (kvguard.sidecar.webconfig.BasicAuth)."""

    users: Mapping[str, bytes]
    user: str
    password: str


_UNAUTHORIZED = {"WWW-Authenticate": 'Basic realm="kvguard", charset="UTF-8"'}


class Application:
    """What each request gets: auth, then one endpoint. Pure of sockets.

    ``route`` runs in the server's event loop and never blocks: it answers what is cheap (the
    probes, errors, 401 and 429, the landing page, a /metrics body already made) and says what
    needs a worker (``BUILD``) or a bcrypt run first (a :class:`Verify`); ``build`` runs in a worker.
    """

    def __init__(
        self,
        sidecar: Sidecar,
        options: ServerOptions,
        exposition: Exposition,
        web_config: Callable[[], WebConfig] | None = None,
    ):
        self.sidecar = sidecar
        self.options = options
        self.exposition = exposition
        self.web_config = web_config or (lambda: WebConfig())
        self.basic_auth = BasicAuth()
        self.guesses = GuessLimiter(options.auth_rate, options.auth_burst)
        # the same budget again, for new credentials on connections that have had one accepted: others'
        # guesses do not use it up, and their own wrong ones do (a second different one refused also
        # ends the connection's trust)
        self.trusted_guesses = GuessLimiter(options.auth_rate, options.auth_burst)
        # and again for first logins (connections that have had fewer than two credentials refused):
        # guesses repeated on refused connections do not use it up (kvguard.sidecar.server's docstring)
        self.fresh_guesses = GuessLimiter(options.auth_rate, options.auth_burst)
        self.authenticated = False  # the last routed request's credential was accepted
        self.refused_key: bytes | None = None  # the last routed request's credential was wrong (not just
        # missing): its keyed digest (BasicAuth.credential_key)
        self.asked: dict[tuple[str, bool], None] = {}  # /metrics formats scraped since the last build ahead

    def route(self, request: Request, source: str = "", trusted: bool = False) -> Response | str | Verify:
        """``trusted``: the connection has had a credential accepted (kvguard.sidecar.server's docstring).
        After the call, ``authenticated`` says whether this request's credential was accepted."""
        self.authenticated, self.refused_key = False, None
        if request.method not in ("GET", "HEAD"):
            return _text(405, "method not allowed\n", headers={"Allow": "GET, HEAD"}, close=True)
        path = request.path
        if path == OPEN_PATHS[0]:  # /healthz: the probes need no credentials
            return _text(200, "ok\n")
        if path == OPEN_PATHS[1]:
            ready = self.exposition.readiness_now(self.options.fail_readiness_on_critical)
            return _text(*ready) if ready is not None else BUILD
        runbook = path == "/runbook" or path.startswith("/runbook/")
        if runbook and self.options.runbook_public:
            # The alerts link here for a person with a browser, not Prometheus' credentials; the text is
            # the packaged runbook, the same in every install (--web.runbook-public).
            return runbook_response(path[len("/runbook/") :] if path != "/runbook" else None)
        verdict = self._authorize(request, self.web_config(), source, trusted)
        if verdict is not True:
            return verdict
        if path == "/metrics":
            gzipped = gzip_accepted(request.headers.get("accept-encoding", ""))
            accept = request.headers.get("accept", "")
            if len(self.asked) < AHEAD_FORMATS:
                self.asked[(accept, gzipped)] = None
            made = self.exposition.parts_now(accept, gzipped)
            return self._metrics(made, gzipped) if made is not None else BUILD
        if path == "/guard":
            return BUILD
        if path == "/":
            return Response(200, landing_page(), "text/html; charset=utf-8")
        if runbook:
            return runbook_response(path[len("/runbook/") :] if path != "/runbook" else None)
        return _text(404, "not found\n")

    def build(self, request: Request) -> Response:
        """/metrics, /guard or /readyz, made (or taken from the refresh's cache) in a worker thread."""
        try:
            path = request.path
            if path == "/metrics":
                gzipped = gzip_accepted(request.headers.get("accept-encoding", ""))
                return self._metrics(self.exposition.parts(request.headers.get("accept", ""), gzipped), gzipped)
            if path == "/guard":
                return Response(200, self.exposition.guard_json(), "application/json")
            if path == "/readyz":
                return _text(*self.exposition.observation().readiness(self.options.fail_readiness_on_critical))
            return _text(404, "not found\n")
        except Exception as exc:  # one line to the client, never a traceback
            message = one_line(exc, first_line=True)
            return _text(500, f"error: {message}\n")

    @staticmethod
    def _metrics(made: tuple[tuple[bytes, ...], str], gzipped: bool) -> Response:
        body, content_type = made
        return Response(200, body, content_type, {"Content-Encoding": "gzip"} if gzipped else {})

    def _authorize(
        self, request: Request, config: WebConfig, source: str, trusted: bool = False
    ) -> Literal[True] | Response | Verify:
        """True, a 401 / 429 answer, or the bcrypt check still to run.

        Credentials bcrypt has to check are admitted by the server per source address (_AuthGate:
        a token each, given back when right; a few places in the queue per address), not here."""
        users = config.basic_auth_users
        user, password = self.options.basic_auth_user, self.options.basic_auth_password
        if not users and user is None:
            return True
        refused = _text(401, "unauthorized\n", headers=dict(_UNAUTHORIZED))
        wrong = _text(401, "unauthorized\n", headers=dict(_UNAUTHORIZED), delay=self.options.auth_failure_delay)
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return refused
        try:
            given_user, sep, given_password = (
                base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
            )
        except (ValueError, UnicodeDecodeError):
            return refused
        if not sep:
            return refused
        if users:
            if self.basic_auth.verified(users, given_user, given_password):
                self.authenticated = True
                return True
            if self.basic_auth.refused(users, given_user, given_password):
                self.refused_key = self.basic_auth.credential_key(users, given_user, given_password)
                return wrong
            return Verify(users, given_user, given_password)  # admitted (or 429) by the server's _AuthGate
        if not user or not password:  # refused at startup; never an open door here either
            return refused
        # Compare both, always, in constant time.
        ok_user = hmac.compare_digest(given_user.encode(), user.encode())
        ok_password = hmac.compare_digest(given_password.encode(), password.encode())
        self.authenticated = ok_user and ok_password
        if not self.authenticated:
            self.refused_key = self.basic_auth.credential_key({}, given_user, given_password)
        return True if ok_user and ok_password else wrong


# ------------------------------------------------------------------------------ connections

# The kinds of credentials bcrypt has to check, by what their connection has shown (_admit): GUESS,
# one that has had two different credentials refused (who sent wrong passwords before); else FRONT,
# one that has had a credential accepted (a rotated password); else FRESH (a first login).
FRONT, FRESH, GUESS = "front", "fresh", "guess"


class _VerifyQueue:
    """Credentials waiting for bcrypt, served FRONT first, then FRESH, then GUESS, each kind in order
    of arrival; at most ``limit`` each of FRESH and GUESS (put() is False beyond). FRONT is bounded
    by the source addresses (_AuthGate: one each)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._ready = threading.Condition()
        self._queues: dict[str, deque[Any]] = {FRONT: deque(), FRESH: deque(), GUESS: deque()}
        self._privileged_running = 0

    def put(self, item: Any, kind: str = GUESS) -> bool:
        with self._ready:
            waiting = self._queues[kind]
            if kind != FRONT and len(waiting) >= self.limit:
                return False
            waiting.append(item)
            self._ready.notify_all()  # the verifier kept for FRONT and FRESH may be the one idle
            return True

    def get(self, kept: bool = False) -> Any:
        """The next item; with ``kept``, the next FRONT or FRESH one (a verifier kept for them). No
        GUESS is handed out while a FRONT or FRESH one is being checked: its bcrypt run has the CPU
        to itself, not shared with a guess's (call done() after each item)."""
        with self._ready:
            while True:
                for kind in (FRONT, FRESH):
                    if self._queues[kind]:
                        item = self._queues[kind].popleft()
                        if item is not None:
                            self._privileged_running += 1
                        return item
                if not kept and self._queues[GUESS] and not self._privileged_running:
                    return self._queues[GUESS].popleft()
                self._ready.wait()

    def done(self, kind: str) -> None:
        if kind != GUESS:
            with self._ready:
                self._privileged_running -= 1
                self._ready.notify_all()

    def stop_one(self) -> None:
        """Wake one verifier with None, its signal to end."""
        with self._ready:
            self._queues[FRONT].appendleft(None)
            self._ready.notify_all()

    def clear(self) -> None:
        with self._ready:
            for waiting in self._queues.values():
                waiting.clear()

    def qsize(self) -> int:
        return sum(len(waiting) for waiting in self._queues.values())


class _AuthGate:
    """Who of one kind of credentials may go to bcrypt now, per source address: a credential takes a
    token from ``limiter`` (given back when bcrypt accepts it) and a place among at most
    ``per_source`` of its address's credentials queued for or in bcrypt. Without a place, or without
    a token while others of its address are still out (each may give one back), it waits, in order,
    behind them; with no token and none out, it is refused (429). So one address with many
    connections holds a few places in bcrypt's queue, never all of them, and guesses at the
    limiter's rate, not at bcrypt's. Thread-safe (the event loop admits, the bcrypt threads finish)."""

    START, WAIT, REFUSE = "start", "wait", "refuse"
    MAX_WAITING = 4096  # per address; past it, closed connections are pruned, then refused

    def __init__(self, limiter: GuessLimiter, per_source: int):
        self.limiter = limiter
        self.per_source = max(1, per_source)
        self._lock = threading.Lock()
        self._out: dict[str, int] = {}  # source -> credentials queued for or in bcrypt
        self._waiting: dict[str, deque[Any]] = {}  # source -> items waiting for one of those

    def try_start(self, source: str) -> bool:
        """Take a place and a token if both are there now (nothing waits)."""
        with self._lock:
            return self._start_locked(source)

    def admit(self, source: str, item: Any) -> str:
        """START (a place and a token taken: queue it), WAIT (kept here) or REFUSE."""
        with self._lock:
            waiting = self._waiting.get(source)
            if not waiting and self._start_locked(source):
                return self.START
            if not self._out.get(source):
                return self.REFUSE
            if waiting is None:
                waiting = self._waiting[source] = deque()
            if len(waiting) >= self.MAX_WAITING:
                waiting = self._waiting[source] = deque(i for i in waiting if not i[0].closed)
                if len(waiting) >= self.MAX_WAITING:
                    return self.REFUSE
            waiting.append(item)
            return self.WAIT

    def finish(self, source: str, accepted: bool) -> tuple[list[Any], list[Any]]:
        """One of ``source``'s credentials is done (``accepted``: its token comes back). Returns the
        waiting items that may start now (places and tokens taken) and those refused."""
        with self._lock:
            out = self._out.get(source, 0) - 1
            if out > 0:
                self._out[source] = out
            else:
                self._out.pop(source, None)
            if accepted:
                self.limiter.refund(source)
            start: list[Any] = []
            waiting = self._waiting.get(source)
            while waiting:
                if waiting[0][0].closed:
                    waiting.popleft()
                    continue
                if not self._start_locked(source):
                    break
                start.append(waiting.popleft())
            refuse: list[Any] = []
            if waiting and not self._out.get(source):  # no token and nothing out that could give one back
                refuse = [item for item in waiting if not item[0].closed]
                waiting.clear()
            if not waiting:
                self._waiting.pop(source, None)
            return start, refuse

    def _start_locked(self, source: str) -> bool:
        out = self._out.get(source, 0)
        if out >= self.per_source or not self.limiter.take(source):
            return False
        self._out[source] = out + 1
        return True

    def waiting(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiting.values())

    def clear(self) -> None:
        with self._lock:
            self._waiting.clear()


class _Conn:
    __slots__ = (
        "sock",
        "address",
        "source",
        "buffer",
        "tls_pending",
        "tls_wants",
        "started",
        "last",
        "events",
        "in_worker",
        "linger_until",
        "drained",
        "out",
        "out_offset",
        "out_bytes",
        "write_deadline",
        "close_after",
        "closed",
        "hold_until",
        "key",
        "trusted",
        "refused_key",
        "refusals",
        "turned_away_keys",
    )

    def __init__(self, sock: socket.socket, address: Any, tls_pending: bool):
        self.sock = sock
        self.key = sock.fileno()  # its entry in the server's table (kept after close)
        self.address = address
        self.source = str(address[0]) if isinstance(address, tuple) and address else str(address)
        self.buffer = bytearray()
        self.tls_pending = tls_pending  # the TLS handshake has not finished
        self.tls_wants = selectors.EVENT_READ
        self.started: float | None = None  # monotonic time of the current head's first byte
        self.last = time.monotonic()  # accepted, or last response sent
        self.events = 0  # what the selector watches for; 0: not registered
        self.in_worker = False  # a request of it is with a worker or bcrypt: nothing else read
        self.linger_until: float | None = None  # answered and shut down for writing: drained until then
        self.drained = 0
        self.out: deque[bytes | memoryview] = deque()  # unsent output, in order (shared chunks, not copies)
        self.out_offset = 0  # sent of out[0]
        self.out_bytes = 0  # unsent, in all
        self.write_deadline: float | None = None  # the unsent output must be gone by then
        self.close_after = False  # the last answer is queued: close (lingering) once it is sent
        self.closed = False
        self.hold_until: float | None = None  # its output is held back until then (a wrong password)
        self.trusted = False  # basic auth accepted a credential on it: its new ones go first
        self.refused_key: bytes | None = None  # the keyed digest of the last credential refused on it
        self.refusals = 0  # different credentials refused on it since one was accepted
        # Credentials turned away unchecked (429) since one was accepted, different from each other and
        # from the refused one: at most two kept, all that guessing() needs.
        self.turned_away_keys: list[bytes] = []

    def accepted(self) -> None:
        """A credential on it was accepted: trusted, and its refusals forgotten, so that the next
        rotation starts again from one refusal."""
        self.trusted, self.refused_key, self.refusals = True, None, 0
        self.turned_away_keys = []

    def turned_away(self, key: bytes) -> None:
        """A credential on it was answered 429, unchecked. The same one presented again stays what it was (a
        client retrying after Retry-After); different ones count towards guessing() as refusals do, so a
        connection cannot stay a first login by being turned away: without this, a keep-alive flood whose
        guesses were all answered 429 kept spending the FRESH tokens of its address, two per connection
        as each got through, for as long as it ran (bench/bench_credentials.py on a quiet machine)."""
        known = self.turned_away_keys + ([self.refused_key] if self.refused_key is not None else [])
        if len(self.turned_away_keys) < 2 and not any(hmac.compare_digest(key, k) for k in known):
            self.turned_away_keys.append(key)

    def refused(self, key: bytes) -> None:
        """A credential on it was answered 401 (``key``: BasicAuth.credential_key). The same one
        presented again is not counted again (an old password repeated until the client re-reads
        its file); a second different one ends its trust, and its credentials are GUESSes from then."""
        # One credential is one count: turned away first, then refused, it is not counted twice.
        self.turned_away_keys = [k for k in self.turned_away_keys if not hmac.compare_digest(key, k)]
        if self.refused_key is None or not hmac.compare_digest(key, self.refused_key):
            self.refused_key, self.refusals = key, self.refusals + 1
        if self.refusals >= 2:
            self.trusted = False

    def guessing(self, key: bytes) -> bool:
        """Whether a credential (``key``) on it is a GUESS: two different ones have been refused on
        it, or it is the one refused (bcrypt's cache of refusals has forgotten it), or two others than
        it have been refused or turned away (429) on it."""
        if self.refusals >= 2 or (self.refused_key is not None and hmac.compare_digest(key, self.refused_key)):
            return True
        others = self.refusals + sum(not hmac.compare_digest(key, k) for k in self.turned_away_keys)
        return others >= 2


class KVGuardServer:
    """The HTTP server; ``start()`` returns once the socket listens, ``serve_forever()`` blocks."""

    def __init__(
        self,
        sidecar: Sidecar,
        options: ServerOptions,
        registry: CollectorRegistry | None = None,
        tls_context: ssl.SSLContext | None = None,
        web_config: WebConfigWatcher | None = None,
    ):
        self.options = options
        self.sidecar = sidecar
        if web_config is None and options.web_config_file:
            web_config = WebConfigWatcher(options.web_config_file, allow_auth_off=options.web_config_allow_auth_off)
        self.web_config = web_config
        if web_config is not None:
            sidecar.web_config_status = web_config.status
        self._static_tls = tls_context or make_tls_context(options)
        self.tls = self._static_tls is not None or (
            web_config is not None and web_config.config.tls_context is not None
        )
        self.exposition = Exposition(sidecar, registry)
        self.app = Application(
            sidecar, options, self.exposition, web_config.current if web_config is not None else None
        )
        family = socket.AF_INET6 if ":" in options.listen else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((options.listen, options.port))
            # A deep accept queue: slowloris clients re-opening by the thousand would otherwise
            # overflow it, and a dropped SYN costs a normal scrape a 1 s retransmit (bench_flood.py).
            self._listener.listen(LISTEN_BACKLOG)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, _Conn] = {}
        self._ready: list[_Conn] = []  # to be read again without waiting for the selector
        self._returned: queue.SimpleQueue[tuple[_Conn, Request, Response]] = queue.SimpleQueue()
        # At most one request per connection is out of the loop, so the queues are bounded by
        # max_connections without a cap of their own: a busy server queues, it does not refuse.
        self._work: queue.PriorityQueue[tuple[int, int, _Conn | None, Any]] = queue.PriorityQueue()
        self._verify = _VerifyQueue(options.auth_queue)
        # Per source address and kind: at most auth_queue_per_source of its credentials in the queue
        # (the rest wait outside it), one at the front; tokens from the app's limiters.
        per_source = min(options.auth_queue_per_source, options.auth_queue)
        self._gates = {
            FRONT: _AuthGate(self.app.trusted_guesses, 1),
            FRESH: _AuthGate(self.app.fresh_guesses, per_source),
            GUESS: _AuthGate(self.app.guesses, per_source),
        }
        self._sequence = itertools.count()
        self._verifying = 0
        self._swept_at = 0.0
        self._building_ahead = False
        self._verifying_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._log_times: list[float] = []
        self.connection_errors_total = 0
        self.connections_evicted_total = 0
        self.write_timeouts_total = 0  # connections closed with output they would not read
        self.requests_total = 0
        self.rejected_total = 0  # 4xx/5xx answered before the request was parsed (408, 431), or 429

    # ------------------------------------------------------------------ public
    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def unsent_bytes(self) -> int:
        """Output queued for peers that have not read it yet, over every connection."""
        return sum(conn.out_bytes for conn in list(self._conns.values()))

    @property
    def pending_verifications(self) -> int:
        """Credentials waiting for (or in) a bcrypt run, those waiting for their address's turn included."""
        return self._verify.qsize() + self._verifying + sum(gate.waiting() for gate in self._gates.values())

    def url(self, path: str = "/", host: str | None = None) -> str:
        host = host or self.options.listen
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1" if host != "::" else "[::1]"
        elif ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}{path}"

    def start(self) -> "KVGuardServer":
        self._start_workers()
        self._thread = threading.Thread(target=self._loop, name="kvguard-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._start_workers()
        self._loop()

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._verify.clear()  # guesses still waiting for bcrypt are dropped, not checked
        for gate in self._gates.values():
            gate.clear()
        for worker in self._workers:
            if worker.name.startswith("kvguard-bcrypt"):
                self._verify.stop_one()
            else:
                self._work.put((-1, 0, None, None))
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._selector.close()
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ the event loop
    def _start_workers(self) -> None:
        if self._workers:
            return
        for index in range(max(1, self.options.workers)):
            worker = threading.Thread(target=self._worker, name=f"kvguard-http-{index}", daemon=True)
            worker.start()
            self._workers.append(worker)
        for index in range(max(1, self.options.auth_workers)):
            # With two or more, the first is kept for FRONT and FRESH credentials (a rotated password,
            # a first login): they wait for one bcrypt run in progress at most, never for guesses.
            kept = index == 0 and self.options.auth_workers > 1
            worker = threading.Thread(target=self._verifier, args=(kept,), name=f"kvguard-bcrypt-{index}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                handled = 0
                for key, events in self._selector.select(timeout=0 if self._ready else 0.25):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        conn = key.data
                        if events & selectors.EVENT_WRITE and not conn.closed:
                            self._writable(conn)
                        if events & selectors.EVENT_READ and not conn.closed:
                            self._readable(conn)
                        handled += 1
                        if handled % ACCEPT_EVERY == 0:
                            # New connections (a probe, a scrape) do not wait for a whole round
                            # of busy keep-alive ones: accepted, read and answered in between.
                            self._accept()
                ready, self._ready = self._ready, []
                for conn in ready:
                    if not conn.closed and not conn.in_worker:
                        self._readable(conn)
                self._take_back()
                self._sweep()
        finally:
            if self._thread is None:  # serve_forever: the caller's thread owns the lifetime
                self.close()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._conns) >= self.options.max_connections and not self._evict():
                sock.close()
                self.connections_evicted_total += 1
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            sock.setblocking(False)
            context = self._tls_context()
            if context is not None:
                try:
                    sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError) as exc:
                    self._connection_error(address, exc)
                    sock.close()
                    continue
            conn = _Conn(sock, address, context is not None)
            self._conns[conn.key] = conn
            self._readable(conn)  # a request sent with the connection is often there already

    def _tls_context(self) -> ssl.SSLContext | None:
        if self.web_config is not None:
            context = self.web_config.current().tls_context
            if context is not None:
                return context
        return self._static_tls

    def _evict(self) -> bool:
        """Close the connections that have waited longest for a complete request (1/64 of the cap
        at a time, so that a churning flood does not cost a scan of every connection per accept);
        False if none may go."""
        waiting = [c for c in self._conns.values() if not c.in_worker]
        if not waiting:
            return False
        # Those already answered and lingering go first, then the longest waiting.
        for oldest in heapq.nsmallest(
            max(1, self.options.max_connections // 64),
            waiting,
            key=lambda c: (c.linger_until is None, c.started if c.started is not None else c.last),
        ):
            self._close(oldest)
            self.connections_evicted_total += 1
        return True

    def _wants_input(self, conn: _Conn) -> bool:
        """Read more from it? Not while a request of it is out of the loop, not once its answers
        are over the output bound (until they drain), not past a complete head or the head cap."""
        return (
            not conn.in_worker
            and not conn.close_after
            and conn.hold_until is None
            and conn.out_bytes <= self.options.output_limit
            and len(conn.buffer) <= self.options.max_header_bytes
            and find_head_end(conn.buffer) < 0
        )

    def _update(self, conn: _Conn) -> None:
        """Watch the connection for what it can use next (nothing, while a worker has it)."""
        if conn.closed:
            return
        if conn.linger_until is not None:
            events = selectors.EVENT_READ
        elif conn.tls_pending:
            events = conn.tls_wants
        elif conn.hold_until is not None:
            events = 0
        else:
            events = selectors.EVENT_WRITE if conn.out else 0
            if self._wants_input(conn):
                events |= selectors.EVENT_READ
        if events == conn.events:
            return
        was_reading = conn.events & selectors.EVENT_READ
        try:
            if not conn.events:
                self._selector.register(conn.sock, events, conn)
            elif not events:
                self._selector.unregister(conn.sock)
            else:
                self._selector.modify(conn.sock, events, conn)
        except (KeyError, ValueError, OSError):
            conn.events = 0
            self._close(conn)
            return
        conn.events = events
        if (
            events & selectors.EVENT_READ
            and not was_reading
            and isinstance(conn.sock, ssl.SSLSocket)
            and not conn.tls_pending
            and conn.sock.pending()
        ):
            self._ready.append(conn)  # bytes already decrypted: the selector would not see them

    def _handshake(self, conn: _Conn) -> bool:
        """Go on with the TLS handshake; True once it is done."""
        try:
            # cast: a connection is TLS-pending only when _accept wrapped its socket (an ssl.SSLSocket).
            cast(ssl.SSLSocket, conn.sock).do_handshake()
        except ssl.SSLWantReadError:
            conn.tls_wants = selectors.EVENT_READ
            self._update(conn)
            return False
        except ssl.SSLWantWriteError:
            conn.tls_wants = selectors.EVENT_WRITE
            self._update(conn)
            return False
        except (OSError, ValueError) as exc:
            self._connection_error(conn.address, exc)
            if isinstance(exc, ssl.SSLError) and exc.reason in _PLAIN_HTTP_REASONS:
                self.rejected_total += 1
                try:  # past the TLS layer: OpenSSL sent nothing (no alert for these reasons)
                    socket.socket.send(conn.sock, PLAIN_HTTP_ON_TLS)
                except OSError:
                    pass
                self._linger(conn)
                return False
            self._close(conn)
            return False
        conn.tls_pending = False
        return True

    def _writable(self, conn: _Conn) -> None:
        if conn.tls_pending:
            if self._handshake(conn):
                self._readable(conn)
            return
        self._flush(conn)
        if not conn.closed:
            self._process(conn)

    def _readable(self, conn: _Conn) -> None:
        sock = conn.sock
        if conn.linger_until is not None:
            self._drain(conn)
            return
        if conn.tls_pending and not self._handshake(conn):
            return
        limit = self.options.max_header_bytes
        while self._wants_input(conn):
            try:
                chunk = sock.recv(min(16384, limit + 1 - len(conn.buffer)) or 1)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                break
            except ssl.SSLWantWriteError:
                break
            except (OSError, ValueError) as exc:
                if not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                    self._connection_error(conn.address, exc)
                self._close(conn)
                return
            if not chunk:
                if conn.out:  # the peer is done sending; it still gets what it asked for
                    conn.close_after = True
                    conn.buffer = bytearray()
                    break
                self._close(conn)
                return
            if conn.started is None:
                conn.started = time.monotonic()
            conn.buffer += chunk
        self._process(conn)

    def _may_answer(self, conn: _Conn) -> bool:
        return (
            not conn.closed
            and not conn.in_worker
            and not conn.close_after
            and conn.hold_until is None
            and conn.out_bytes <= self.options.output_limit
        )

    def _process(self, conn: _Conn) -> None:
        """Answer the complete requests in its buffer, in order, while it may: one at a time
        while a worker has one, none while its output is over the bound."""
        served = 0
        while True:
            while served < REQUESTS_PER_TURN and self._may_answer(conn) and self._answer_next(conn):
                served += 1
            self._flush(conn)  # may take it back under the bound: then on with the buffer
            if not self._may_answer(conn) or find_head_end(conn.buffer) < 0:
                break
            if served >= REQUESTS_PER_TURN:  # the others' turn; back to this one right after
                self._ready.append(conn)
                break
        self._update(conn)

    def _answer_next(self, conn: _Conn) -> bool:
        """Answer (or hand on) the first complete request in the buffer; False when there is none."""
        end = find_head_end(conn.buffer)
        if end < 0:
            if len(conn.buffer) > self.options.max_header_bytes:
                self._reject(conn, 431, f"request head over {self.options.max_header_bytes} bytes\n")
            elif not _request_line_ok(conn.buffer):
                # An HTTP/0.9 request ("GET /") has no header block to wait for: answered at once, as Go does.
                self._reject(conn, 400, "malformed request line\n")
            elif not conn.buffer:
                conn.started = None
            elif conn.started is None:
                conn.started = time.monotonic()
            return False
        head = bytes(conn.buffer[:end])
        del conn.buffer[:end]
        conn.started = None
        self.requests_total += 1
        try:
            request = parse_request(head, self.options.max_headers)
        except BadRequest as exc:
            self._respond(conn, None, _text(exc.status, f"{exc}\n"))
            return False
        outcome = self.app.route(request, conn.source, conn.trusted)
        if isinstance(outcome, Response):
            if outcome.status in (401, 429):
                self.rejected_total += outcome.status == 429
                if self.app.refused_key is not None:  # a wrong credential, not a missing one
                    conn.refused(self.app.refused_key)
            elif self.app.authenticated:
                conn.accepted()
            self._respond(conn, request, outcome)
        elif isinstance(outcome, Verify):
            self._admit(conn, request, outcome)
        else:
            if self.app.authenticated:
                conn.accepted()
            conn.in_worker = True
            self._work.put((_PROBE if request.path == "/readyz" else _SCRAPE, next(self._sequence), conn, request))
        return True

    def _too_many(self, text: str) -> Response:
        return _text(429, text, headers={"Retry-After": "1"}, delay=self.options.auth_failure_delay)

    def _admit(self, conn: _Conn, request: Request, check: Verify) -> None:
        """Hand credentials to bcrypt, keep them waiting for their address's turn, or answer 429
        (_AuthGate), by kind: on a connection that has had two different credentials refused or
        turned away (429), or the one refused again, a GUESS; else, on a connection that has had a credential accepted,
        at the front of the queue while its address has no other there and trusted tokens left
        (FRONT); else a first login (FRESH). One refusal demotes nothing: a password rotation
        always costs the old one a 401 on the connection that then sends the new one. Each kind
        has tokens of its own per address, so guesses repeated on connections already refused (a
        keep-alive flood) never use up the tokens of a first login from the same address. A 429
        checks no credential; the same one retried after it keeps its kind (_Conn.turned_away)."""
        conn.in_worker = True
        key = self.app.basic_auth.credential_key(check.users, check.user, check.password)
        guessing = conn.guessing(key)
        if not guessing and conn.trusted and self._gates[FRONT].try_start(conn.source):
            self._enqueue((conn, request, check, FRONT))
            return
        kind = GUESS if guessing else FRESH
        verdict = self._gates[kind].admit(conn.source, (conn, request, check, kind))
        if verdict == _AuthGate.START:
            self._enqueue((conn, request, check, kind))
        elif verdict == _AuthGate.REFUSE:
            conn.in_worker = False
            conn.turned_away(key)
            self.rejected_total += 1
            self._respond(
                conn, request, self._too_many("too many unverified credentials from this address; retry later\n")
            )

    def _enqueue(self, item: tuple) -> None:
        """Queue an admitted credential for bcrypt; if the queue is full, 429 and its place given back.
        Any thread (the event loop, or a bcrypt thread starting the next of an address)."""
        if not self._verify.put(item, item[3]):
            self._finished(item[0].source, item[3], True, item)

    def _finished(self, source: str, kind: str, accepted: bool, unqueued: tuple | None = None) -> None:
        """One credential of ``source`` is done with bcrypt (or, ``unqueued``, found the queue full:
        429, its token given back): start those of its address next in line, or refuse them once it
        has neither tokens nor credentials out. A FRESH one refused uses up a GUESS token of its
        address too: what a connection guesses first is paid from both budgets."""
        gate = self._gates[kind]
        if kind == FRESH and not accepted and unqueued is None:
            self.app.guesses.spend(source)
        refused = [(unqueued, "too many credentials waiting; retry later\n")] if unqueued else []
        done = 1
        while done:
            done -= 1
            start, refuse = gate.finish(source, accepted)
            accepted = True  # the rest of the loop: places of credentials never checked
            refused += [(item, "too many unverified credentials from this address; retry later\n") for item in refuse]
            for item in start:
                if not self._verify.put(item, item[3]):
                    refused.append((item, "too many credentials waiting; retry later\n"))
                    done += 1  # its place and token back, in this loop rather than recursing
        for (conn, request, check, _), text in refused:
            self.rejected_total += 1
            # (Its connection is in a worker's hands: the event loop does not touch it until handed back.)
            conn.turned_away(self.app.basic_auth.credential_key(check.users, check.user, check.password))
            self._hand_back(conn, request, self._too_many(text))

    def _respond(self, conn: _Conn, request: Request | None, response: Response) -> None:
        """Queue one answer on the connection (sent by _flush, never blocking)."""
        keep = request is not None and request.keep_alive and not response.close and not self._stop.is_set()
        extra = self.web_config.current().headers if self.web_config is not None else {}
        pieces = [encode_head(response, keep, extra)]
        if request is None or request.method != "HEAD":
            pieces += [chunk for chunk in response.chunks if chunk]
        for piece in pieces:
            conn.out.append(piece)
            conn.out_bytes += len(piece)
        if response.delay > 0:
            conn.hold_until = time.monotonic() + response.delay
        if conn.write_deadline is None:
            conn.write_deadline = time.monotonic() + self.options.request_timeout + response.delay
        if not keep:
            conn.close_after = True
            conn.buffer = bytearray()

    def _flush(self, conn: _Conn) -> None:
        """Send what the socket takes now; what it does not stays queued (EVENT_WRITE)."""
        if conn.hold_until is not None:
            return
        out = conn.out
        gather = not isinstance(conn.sock, ssl.SSLSocket)
        while out and not conn.closed:
            try:
                if gather:  # one writev of the queued pieces: the shared chunks, never joined
                    pieces: list[bytes | memoryview] = []
                    size = 0
                    for piece in out:
                        pieces.append(memoryview(piece)[conn.out_offset :] if not pieces else piece)
                        size += len(pieces[-1])
                        if len(pieces) >= GATHER_PIECES or size >= GATHER_BYTES:
                            break
                    sent = conn.sock.sendmsg(pieces)
                else:
                    sent = conn.sock.send(self._first_piece(conn))
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except (OSError, ValueError):
                self._close(conn)
                return
            if not sent:
                return
            conn.out_bytes -= sent
            while sent:
                left = len(out[0]) - conn.out_offset
                if sent < left:
                    conn.out_offset += sent
                    break
                sent -= left
                out.popleft()
                conn.out_offset = 0
        if not out and not conn.closed:
            conn.write_deadline = None
            conn.last = time.monotonic()
            if conn.close_after:
                self._linger(conn)

    @staticmethod
    def _first_piece(conn: _Conn) -> memoryview:
        """What one TLS write sends: small pieces (a head, a short body) joined up to COALESCE_BYTES,
        never re-joined once partly sent (a TLS write that must be retried is retried as it was)."""
        out = conn.out
        first = out[0]
        if not conn.out_offset and len(first) < COALESCE_BYTES and len(out) > 1 and len(out[1]) < COALESCE_BYTES:
            pieces = [out.popleft()]
            size = len(first)
            while out and size + len(out[0]) <= COALESCE_BYTES:
                size += len(out[0])
                pieces.append(out.popleft())
            first = b"".join(pieces)
            out.appendleft(first)
        return memoryview(first)[conn.out_offset :]

    def _reject(self, conn: _Conn, status: int, text: str) -> None:
        """Answer one short error before a request could be parsed, then close lingering."""
        self.rejected_total += 1
        self._respond(conn, None, _text(status, text))
        self._flush(conn)
        self._update(conn)

    def _linger(self, conn: _Conn) -> None:
        """Close after an answer without a reset: shut down writes (the peer reads the answer and
        then end of file), then read and drop what it still sends until it closes, for at most
        LINGER_SECONDS and LINGER_BYTES (kvguard.sidecar.server's docstring)."""
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)  # an SSLSocket drops its TLS layer here: raw reads from now
        except (OSError, ValueError):
            self._close(conn)
            return
        conn.linger_until = time.monotonic() + LINGER_SECONDS
        conn.hold_until = None
        conn.buffer = bytearray()
        conn.out.clear()
        conn.out_bytes = conn.out_offset = 0
        conn.write_deadline = None
        conn.tls_pending = False
        conn.started = None
        self._update(conn)
        if not conn.closed:
            self._drain(conn)

    def _drain(self, conn: _Conn) -> None:
        while True:
            try:
                chunk = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except (OSError, ValueError):
                chunk = b""
            conn.drained += len(chunk)
            if not chunk or conn.drained > LINGER_BYTES:
                self._close(conn)
                return

    def _take_back(self) -> None:
        while True:
            try:
                conn, request, response = self._returned.get_nowait()
            except queue.Empty:
                return
            conn.in_worker = False
            if conn.closed:
                continue
            if self._stop.is_set():
                self._close(conn)
                continue
            self._respond(conn, request, response)
            self._process(conn)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept_at < SWEEP_SECONDS:
            return
        self._swept_at = now
        self._build_ahead()
        for conn in list(self._conns.values()):
            if conn.in_worker or conn.closed:
                continue
            if conn.hold_until is not None:
                if now >= conn.hold_until:
                    conn.hold_until = None
                    self._process(conn)
                continue
            if conn.linger_until is not None:
                if now > conn.linger_until:
                    self._close(conn)
                continue
            if conn.out_bytes:
                if conn.write_deadline is not None and now > conn.write_deadline:
                    self.write_timeouts_total += 1  # it would not read its answers: no lingering either
                    self._close(conn)
                continue
            if conn.started is not None or conn.tls_pending:
                if now - (conn.started or conn.last) > self.options.header_timeout:
                    if conn.started is not None and not conn.tls_pending:
                        self._reject(conn, 408, "request head not received in time\n")
                    else:
                        self._close(conn)
            elif now - conn.last > self.options.request_timeout:
                self._close(conn)

    def _build_ahead(self) -> None:
        """When the refresh moves on, build what was scraped during the last one in a worker, so
        that the next scrapes find it made (a scrape that comes first still builds, as before).
        Only formats asked for since the last build ahead: scrapers slower than the refresh cost
        no extra builds."""
        if self._building_ahead or not self.app.asked or not self.exposition.stale_now():
            return
        formats, self.app.asked = tuple(self.app.asked), {}
        self._building_ahead = True
        self._work.put((_AHEAD, next(self._sequence), None, formats))

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.events:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.events = 0
        if self._conns.get(conn.key) is conn:
            del self._conns[conn.key]
        conn.out.clear()
        conn.out_bytes = 0
        try:
            conn.sock.close()
        except OSError:
            pass

    def _connection_error(self, address: Any, error: BaseException) -> None:
        """One line per failed connection (plain HTTP on the TLS port, a reset), at most 10 a minute."""
        self.connection_errors_total += 1
        now = time.monotonic()
        self._log_times = [t for t in self._log_times if now - t < 60.0]
        if len(self._log_times) >= 10:
            return
        self._log_times.append(now)
        message = one_line(error, first_line=True)
        host = address[0] if isinstance(address, tuple) and address else address
        print(f"kvguard serve: connection from {host}: {message[:200]}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ workers
    def _hand_back(self, conn: _Conn, request: Request, response: Response) -> None:
        self._returned.put((conn, request, response))
        self._wake()

    def _worker(self) -> None:
        """Builds /metrics, /guard (and /readyz after a refresh); the event loop sends them."""
        while True:
            _, _, conn, request = self._work.get()
            if conn is None and request:  # formats to build ahead
                for accept, gzipped in request:
                    try:
                        self.exposition.parts(accept, gzipped)
                    except Exception:  # noqa: BLE001 - the scrape that needs it will say why
                        break
                self._building_ahead = False
                continue
            if conn is None or request is None:
                return
            try:
                response = self.app.build(request)
            except Exception as exc:  # noqa: BLE001 - a worker outlives any one request
                response = _text(500, f"error: {type(exc).__name__}\n")
            self._hand_back(conn, request, response)

    def _verifier(self, kept: bool = False) -> None:
        """Runs bcrypt for credentials not verified yet, apart from the workers: a flood of guesses
        waits here, never in front of a scrape whose credentials are already verified (nor, with
        ``kept``, in front of a rotated password or a first login: _VerifyQueue)."""
        while True:
            item = self._verify.get(kept)
            if item is None:
                return
            conn, request, check, kind = item
            with self._verifying_lock:
                self._verifying += 1
            try:
                ok = self.app.basic_auth.verify(check.users, check.user, check.password)
            except Exception:  # noqa: BLE001
                ok = False
            finally:
                self._verify.done(kind)
                with self._verifying_lock:
                    self._verifying -= 1
            if ok:
                conn.accepted()
                self._work.put((_SCRAPE, next(self._sequence), conn, request))
            else:
                conn.refused(self.app.basic_auth.credential_key(check.users, check.user, check.password))
                self._hand_back(
                    conn,
                    request,
                    _text(401, "unauthorized\n", headers=dict(_UNAUTHORIZED), delay=self.options.auth_failure_delay),
                )
            # the guesser's address pays (its token is not given back), not those who get it right
            self._finished(conn.source, kind, ok)


_LANDING_LINKS = (
    ("metrics", "the Prometheus exposition"),
    ("guard", "the guard's verdict per rank, JSON"),
    ("runbook", "what each alert means and what to do, one section per alert"),
    ("healthz", "liveness"),
    ("readyz", "readiness"),
)


def landing_page() -> bytes:
    """The page at ``/``, as exporters built on exporter-toolkit serve one (``web/landing_page.go``):
    the name, the version and a link to each endpoint. Behind the same auth as ``/metrics`` (there
    authentication wraps the whole handler, the landing page included). Links are relative, so they
    work behind a path prefix."""
    from kvguard import __version__  # noqa: PLC0415

    items = "\n".join(f'<li><a href="{path}">/{path}</a>: {text}</li>' for path, text in _LANDING_LINKS)
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>kvguard</title></head>\n'
        f"<body>\n<h1>kvguard</h1>\n<p>Allocator memory exporter and KV-cache OOM guard for LLM serving. "
        f"Version {__version__}.</p>\n<ul>\n{items}\n</ul>\n</body>\n</html>\n"
    ).encode()


# ------------------------------------------------------------------------------ the runbook

RUNBOOK_RESOURCE = "runbook.md"  # package data of kvguard (pyproject.toml), one section per alert
_HEADING = re.compile(r"^(#{1,2}) +(.+?) *$", re.MULTILINE)


@dataclass(frozen=True)
class RunbookPages:
    whole: bytes
    sections: Mapping[str, bytes]  # alert name in lower case -> its section's page


@functools.cache
def runbook_pages(resource: str = RUNBOOK_RESOURCE) -> RunbookPages | None:
    """The packaged runbook as HTML pages, read once; None when the install lacks it."""
    try:
        text = importlib.resources.files("kvguard").joinpath(resource).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    # Split before each "## " heading: the preamble, then one part per alert.
    starts = [m.start() for m in _HEADING.finditer(text) if m.group(1) == "##"]
    parts = [text[a:b] for a, b in zip([0, *starts], [*starts, len(text)])]
    sections = {}
    for part in parts[1:]:
        heading = _HEADING.match(part)
        assert heading is not None  # each part after the preamble starts at a "## " heading
        name = heading.group(2)
        sections[name.lower()] = _runbook_html(
            f"kvguard runbook: {name}", part, '<p><a href="../runbook">The whole runbook</a></p>\n'
        )
    return RunbookPages(_runbook_html("kvguard runbook", text), sections)


def _runbook_html(title: str, markdown: str, lead: str = "") -> bytes:
    """markdown as a page: its headings as headings (with an id, so #anchors work; on the whole
    runbook, each alert's linked to its own page), the text between them as it is, escaped, in <pre>.
    Links are relative, so they work behind a path prefix."""
    body, at = [], 0
    for match in _HEADING.finditer(markdown):
        body.append(_pre(markdown[at : match.start()]))
        level, name = len(match.group(1)), html.escape(match.group(2))
        if level == 2:
            slug = html.escape(match.group(2).lower(), quote=True)
            body.append(
                f'<h2 id="{slug}">{name}</h2>\n'
                if lead
                else f'<h2 id="{slug}"><a href="runbook/{slug}">{name}</a></h2>\n'
            )
        else:
            body.append(f"<h1>{name}</h1>\n")
        at = match.end()
    body.append(_pre(markdown[at:]))
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
        "<style>pre { white-space: pre-wrap; font-family: inherit; }</style></head>\n<body>\n"
        f"{lead}{''.join(body)}</body>\n</html>\n"
    ).encode("utf-8")


def _pre(text: str) -> str:
    text = text.strip("\n")
    return f"<pre>{html.escape(text)}</pre>\n" if text.strip() else ""


def runbook_response(name: str | None) -> Response:
    """GET /runbook (name None) or /runbook/<alertname>, the name in any case."""
    pages = runbook_pages(RUNBOOK_RESOURCE)
    if pages is None:
        return _text(404, "the runbook is not installed with this kvguard\n")
    if name is None:
        return Response(200, pages.whole, "text/html; charset=utf-8")
    page = pages.sections.get(name.lower())
    if page is None:
        return _text(404, f"no runbook section for {name[:100]!r}\n")
    return Response(200, page, "text/html; charset=utf-8")
