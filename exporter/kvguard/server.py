"""The sidecar's HTTP endpoints: /metrics, /healthz, /readyz, /guard, a landing page at /; 404 for anything else.

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
- complete requests go to a fixed pool of ``workers`` threads (a bounded queue; 503 when full);
- a request with a body (``405``, or a GET with Content-Length / Transfer-Encoding) is answered
  and the connection closed, so a body is never read as the next request;
- a connection the server ends after an answer (an error, ``Connection: close``) is closed
  lingering, as Apache and Go do: writes shut down, what the peer still sends read and dropped
  for at most ``LINGER_SECONDS`` / ``LINGER_BYTES``, then closed, so unread input does not turn
  the close into a reset that can destroy the answer (a 431) before the peer reads it;
- plain HTTP sent to the TLS port is answered 400 with a sentence, in plain text, as Go's
  net/http answers it;
- TCP_NODELAY on every connection, so a keep-alive scrape does not wait on Nagle / delayed ACK.

/metrics and /guard are made once per sidecar refresh (kvguard.exposition), whatever the scrape rate:
parallel scrapes share one observation, one collection, each format and its gzip; a large body is
sent from the shared chunks, never joined or copied per scrape.

TLS and basic auth come from ``--web.config.file`` (exporter-toolkit format, kvguard.webconfig,
re-read on change) or the shorthand flags; the probes (/healthz, /readyz) stay open so the
kubelet can reach them without credentials.
"""

from __future__ import annotations

import base64
import hmac
import queue
import re
import selectors
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from kvguard.exposition import Exposition
from kvguard.sidecar import Sidecar
from kvguard.webconfig import BasicAuth, WebConfig, WebConfigWatcher

OPEN_PATHS = ("/healthz", "/readyz")
LISTEN_BACKLOG = 1024          # the kernel caps it at net.core.somaxconn (4096 on current kernels)
ACCEPTS_PER_WAKEUP = 256
# Apache's lingering close waits 2 s per read (SECONDS_TO_LINGER), 30 s in all; here 2 s in all,
# and at most LINGER_BYTES dropped, so a peer cannot hold a lingering connection busy.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20
# Go's net/http answer to a TLS record header that looks like HTTP (server.go, (*conn).serve,
# tlsRecordHeaderLooksLikeHTTP), written on the raw connection.
PLAIN_HTTP_ON_TLS = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
# OpenSSL's reasons for a handshake whose first bytes are an HTTP request (ssl/record/ssl3_record.c).
_PLAIN_HTTP_REASONS = ("HTTP_REQUEST", "HTTPS_PROXY_REQUEST")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


@dataclass(frozen=True)
class ServerOptions:
    listen: str = "0.0.0.0"
    port: int = 10240
    fail_readiness_on_critical: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    basic_auth_user: str | None = None
    basic_auth_password: str | None = None
    web_config_file: str | None = None
    request_timeout: float = 30.0       # writing a response; also the idle keep-alive limit
    header_timeout: float = 10.0        # from a request's first byte to the end of its head
    max_header_bytes: int = 32 * 1024   # request line and headers together
    max_headers: int = 100
    max_connections: int = 256
    workers: int = 8


def make_tls_context(options: ServerOptions) -> ssl.SSLContext | None:
    """The flags' TLS context, or None without TLS. Raises OSError or ssl.SSLError on a bad cert or key."""
    if not options.tls_cert_file:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(options.tls_cert_file, options.tls_key_file)
    return context


def _gzip_accepted(header: str | None) -> bool:
    return any(part.split(";")[0].strip().lower() == "gzip" for part in (header or "").split(","))


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
    headers: Mapping[str, str]       # lower-case names
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
    while lines and lines[0] == "":   # RFC 9112 2.2: ignore empty lines before the request line
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
    if not target or any(ord(c) <= 32 or ord(c) >= 127 for c in target) or \
            not (target.startswith("/") or target == "*" or target.startswith(("http://", "https://"))):
        raise BadRequest(400, "malformed request target")
    if target == "*" and method != "OPTIONS":   # RFC 9112 3.2.4: the asterisk form is OPTIONS' only
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
    if version == "HTTP/1.1" and "host" not in headers:   # RFC 9112 3.2: MUST answer 400
        raise BadRequest(400, "an HTTP/1.1 request needs a Host header")
    connection = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    has_body = "transfer-encoding" in headers
    if "content-length" in headers:
        length = headers["content-length"]
        if not _DIGITS.match(length):   # ASCII digits only: str.isdigit() is true for "²", int() refuses it
            raise BadRequest(400, "malformed Content-Length")
        has_body = has_body or int(length) > 0
    return Request(method, target, version, headers, keep_alive and not has_body, has_body)


# ------------------------------------------------------------------------------ responses

@dataclass
class Response:
    status: int
    body: bytes | tuple[bytes, ...]     # or chunks sent in order (the cached /metrics, never joined)
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False

    @property
    def chunks(self) -> tuple[bytes, ...]:
        return (self.body,) if isinstance(self.body, bytes) else self.body

    @property
    def length(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)


def _text(status: int, text: str, **kw: Any) -> Response:
    return Response(status, text.encode("utf-8", "replace"), **kw)


def encode_head(response: Response, keep_alive: bool, extra: Mapping[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}",
             "Server: kvguard", f"Content-Type: {response.content_type}", f"Content-Length: {response.length}"]
    lines += [f"{k}: {v}" for k, v in {**extra, **response.headers}.items()]
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


def encode_response(response: Response, head_only: bool, keep_alive: bool, extra: Mapping[str, str]) -> bytes:
    head = encode_head(response, keep_alive, extra)
    return head if head_only else b"".join((head,) + response.chunks)


# Writes up to this size are joined into one send (with TCP_NODELAY, each send is a segment);
# larger chunks (a big spool's exposition, shared by every scrape of a refresh) go out as they
# are, never copied per scrape.
COALESCE_BYTES = 64 * 1024


def send_response(sock: socket.socket, head: bytes, chunks: tuple[bytes, ...]) -> None:
    pending: list[bytes] = [head]
    size = len(head)
    for chunk in chunks:
        if size + len(chunk) > COALESCE_BYTES and pending:
            sock.sendall(b"".join(pending))
            pending, size = [], 0
        if len(chunk) > COALESCE_BYTES:
            sock.sendall(chunk)
        else:
            pending.append(chunk)
            size += len(chunk)
    if pending:
        sock.sendall(b"".join(pending))


class Application:
    """What each request gets: auth, then one endpoint. Pure of sockets (tests call it directly)."""

    def __init__(self, sidecar: Sidecar, options: ServerOptions, exposition: Exposition,
                 web_config: Callable[[], WebConfig] | None = None):
        self.sidecar = sidecar
        self.options = options
        self.exposition = exposition
        self.web_config = web_config or (lambda: WebConfig())
        self.basic_auth = BasicAuth()

    def handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return _text(405, "method not allowed\n", headers={"Allow": "GET, HEAD"}, close=True)
        path = request.path
        config = self.web_config()
        if path not in OPEN_PATHS and not self._authorized(request, config):
            return _text(401, "unauthorized\n",
                         headers={"WWW-Authenticate": 'Basic realm="kvguard", charset="UTF-8"'})
        try:
            if path == "/metrics":
                body, content_type = self.exposition.parts(request.headers.get("accept", ""),
                                                           _gzip_accepted(request.headers.get("accept-encoding")))
                headers = {"Content-Encoding": "gzip"} if _gzip_accepted(request.headers.get("accept-encoding")) else {}
                return Response(200, body, content_type, headers)
            if path == "/healthz":
                return _text(200, "ok\n")
            if path == "/readyz":
                return self._readyz()
            if path == "/guard":
                return Response(200, self.exposition.guard_json(), "application/json")
            if path == "/":
                return Response(200, landing_page(), "text/html; charset=utf-8")
            return _text(404, "not found\n")
        except Exception as exc:  # one line to the client, never a traceback
            message = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            return _text(500, f"error: {message}\n")

    def _authorized(self, request: Request, config: WebConfig) -> bool:
        users = config.basic_auth_users
        user, password = self.options.basic_auth_user, self.options.basic_auth_password
        if not users and user is None:
            return True
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given_user, sep, given_password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8") \
                .partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        if not sep:
            return False
        if users:
            return self.basic_auth.check(users, given_user, given_password)
        if not user or not password:   # refused at startup; never an open door here either
            return False
        # Compare both, always, in constant time.
        ok_user = hmac.compare_digest(given_user.encode(), user.encode())
        ok_password = hmac.compare_digest(given_password.encode(), password.encode())
        return ok_user and ok_password

    def _readyz(self) -> Response:
        status, body = self.exposition.observation().readiness(self.options.fail_readiness_on_critical)
        return _text(status, body)


# ------------------------------------------------------------------------------ connections

class _Conn:
    __slots__ = ("sock", "address", "buffer", "tls_pending", "started", "last", "events", "in_worker",
                 "linger_until", "drained")

    def __init__(self, sock: socket.socket, address: Any, tls_pending: bool):
        self.sock = sock
        self.address = address
        self.buffer = bytearray()
        self.tls_pending = tls_pending       # the TLS handshake has not finished
        self.started: float | None = None    # monotonic time of the current head's first byte
        self.last = time.monotonic()         # accepted, or last response sent
        self.events = selectors.EVENT_READ
        self.in_worker = False
        self.linger_until: float | None = None   # answered and shut down for writing: drained until then
        self.drained = 0


class KVGuardServer:
    """The HTTP server; ``start()`` returns once the socket listens, ``serve_forever()`` blocks."""

    def __init__(self, sidecar: Sidecar, options: ServerOptions, registry: CollectorRegistry | None = None,
                 tls_context: ssl.SSLContext | None = None, web_config: WebConfigWatcher | None = None):
        self.options = options
        self.sidecar = sidecar
        if web_config is None and options.web_config_file:
            web_config = WebConfigWatcher(options.web_config_file)
        self.web_config = web_config
        self._static_tls = tls_context or make_tls_context(options)
        self.tls = self._static_tls is not None or (web_config is not None and
                                                    web_config.config.tls_context is not None)
        self.exposition = Exposition(sidecar, registry)
        self.app = Application(sidecar, options, self.exposition,
                               web_config.current if web_config is not None else None)
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
        self._returned: queue.SimpleQueue[tuple[_Conn, bool]] = queue.SimpleQueue()
        self._work: queue.Queue[tuple[_Conn, bytes] | None] = queue.Queue(maxsize=max(4, options.workers * 8))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._log_times: list[float] = []
        self.connection_errors_total = 0
        self.connections_evicted_total = 0
        self.requests_total = 0
        self.rejected_total = 0      # 4xx/5xx answered before a worker saw the request

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
        for _ in self._workers:
            try:
                self._work.put_nowait(None)
            except queue.Full:
                pass
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

    # ------------------------------------------------------------------ the selector thread
    def _start_workers(self) -> None:
        if self._workers:
            return
        for index in range(max(1, self.options.workers)):
            worker = threading.Thread(target=self._worker, name=f"kvguard-http-{index}", daemon=True)
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
                for key, events in self._selector.select(timeout=0.25):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._readable(key.data)
                self._take_back()
                self._sweep()
        finally:
            if self._thread is None:   # serve_forever: the caller's thread owns the lifetime
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
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _tls_context(self) -> ssl.SSLContext | None:
        if self.web_config is not None:
            context = self.web_config.current().tls_context
            if context is not None:
                return context
        return self._static_tls

    def _evict(self) -> bool:
        """Close the connection that has waited longest for a complete request; False if none may go."""
        waiting = [c for c in self._conns.values() if not c.in_worker]
        if not waiting:
            return False
        # Those already answered and lingering go first, then the longest waiting.
        oldest = min(waiting, key=lambda c: (c.linger_until is None, c.started if c.started is not None else c.last))
        self._close(oldest)
        self.connections_evicted_total += 1
        return True

    def _readable(self, conn: _Conn) -> None:
        sock = conn.sock
        if conn.linger_until is not None:
            self._drain(conn)
            return
        if conn.tls_pending:
            try:
                sock.do_handshake()
                conn.tls_pending = False
                self._set_events(conn, selectors.EVENT_READ)
            except ssl.SSLWantReadError:
                self._set_events(conn, selectors.EVENT_READ)
                return
            except ssl.SSLWantWriteError:
                self._set_events(conn, selectors.EVENT_WRITE)
                return
            except (OSError, ValueError) as exc:
                self._connection_error(conn.address, exc)
                if isinstance(exc, ssl.SSLError) and exc.reason in _PLAIN_HTTP_REASONS:
                    self.rejected_total += 1
                    try:   # past the TLS layer: OpenSSL sent nothing (no alert for these reasons)
                        socket.socket.send(sock, PLAIN_HTTP_ON_TLS)
                    except OSError:
                        pass
                    self._linger(conn)
                    return
                self._close(conn)
                return
        limit = self.options.max_header_bytes
        while True:
            try:
                chunk = sock.recv(min(16384, limit + 1 - len(conn.buffer)) or 1)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                break
            except ssl.SSLWantWriteError:
                self._set_events(conn, selectors.EVENT_WRITE)
                break
            except (OSError, ValueError) as exc:
                if not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                    self._connection_error(conn.address, exc)
                self._close(conn)
                return
            if not chunk:
                self._close(conn)
                return
            if conn.started is None:
                conn.started = time.monotonic()
            conn.buffer += chunk
            if find_head_end(conn.buffer) >= 0 or len(conn.buffer) > limit:
                break
        end = find_head_end(conn.buffer)
        if end < 0:
            if len(conn.buffer) > limit:
                self._reject(conn, 431, f"request head over {limit} bytes\n")
            return
        self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.in_worker = True
        try:
            self._work.put_nowait((conn, b""))
        except queue.Full:
            conn.in_worker = False
            self._reject(conn, 503, "busy\n", registered=False)

    def _reject(self, conn: _Conn, status: int, text: str, registered: bool = True) -> None:
        """Answer one short error and close (non-blocking: a peer that does not read loses it)."""
        self.rejected_total += 1
        data = encode_response(_text(status, text), False, False, {})
        try:
            conn.sock.setblocking(False)
            conn.sock.send(data)
        except (OSError, ValueError):
            pass
        self._linger(conn, registered)

    def _linger(self, conn: _Conn, registered: bool = True) -> None:
        """Close after an answer without a reset: shut down writes (the peer reads the answer and
        then end of file), then read and drop what it still sends until it closes, for at most
        LINGER_SECONDS and LINGER_BYTES (kvguard.server's docstring)."""
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)   # an SSLSocket drops its TLS layer here: raw reads from now
        except (OSError, ValueError):
            self._close(conn, registered)
            return
        conn.linger_until = time.monotonic() + LINGER_SECONDS
        conn.buffer = bytearray()
        conn.tls_pending = False
        conn.started = None
        try:
            if registered:
                self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
            else:
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            conn.events = selectors.EVENT_READ
        except (KeyError, ValueError, OSError):
            self._close(conn, registered=False)
            return
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

    def _set_events(self, conn: _Conn, events: int) -> None:
        if conn.events != events:
            conn.events = events
            try:
                self._selector.modify(conn.sock, events, conn)
            except (KeyError, ValueError, OSError):
                pass

    def _take_back(self) -> None:
        while True:
            try:
                conn, keep = self._returned.get_nowait()
            except queue.Empty:
                return
            conn.in_worker = False
            if self._stop.is_set():
                self._close(conn, registered=False)
                continue
            if not keep:
                self._linger(conn, registered=False)
                continue
            conn.events = selectors.EVENT_READ
            try:
                conn.sock.setblocking(False)
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            except (KeyError, ValueError, OSError):
                self._close(conn, registered=False)
                continue
            if isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():
                self._readable(conn)   # bytes already decrypted: the selector would not see them

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.in_worker:
                continue
            if conn.linger_until is not None:
                if now > conn.linger_until:
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

    def _close(self, conn: _Conn, registered: bool = True) -> None:
        fileno = None
        try:
            fileno = conn.sock.fileno()
        except (OSError, ValueError):
            pass
        if registered:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
        for key, value in list(self._conns.items()):
            if value is conn:
                del self._conns[key]
                break
        else:
            if fileno is not None:
                self._conns.pop(fileno, None)
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
        message = (str(error).splitlines() or [""])[0] or type(error).__name__
        host = address[0] if isinstance(address, tuple) and address else address
        print(f"kvguard serve: connection from {host}: {message[:200]}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ workers
    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            conn, _ = item
            keep = False
            try:
                keep = self._serve(conn)
            except Exception:   # noqa: BLE001 - a worker outlives any one connection
                keep = False
            self._returned.put((conn, keep))
            self._wake()

    def _serve(self, conn: _Conn) -> bool:
        """Answer every complete request in the buffer; True to keep the connection."""
        sock = conn.sock
        sock.settimeout(self.options.request_timeout)
        while True:
            end = find_head_end(conn.buffer)
            if end < 0:
                if len(conn.buffer) > self.options.max_header_bytes:
                    return False
                conn.started = time.monotonic() if conn.buffer else None
                return True
            head = bytes(conn.buffer[:end])
            del conn.buffer[:end]
            self.requests_total += 1
            extra = self.web_config.current().headers if self.web_config is not None else {}
            try:
                request = parse_request(head, self.options.max_headers)
            except BadRequest as exc:
                sock.sendall(encode_response(_text(exc.status, f"{exc}\n"), False, False, extra))
                return False
            response = self.app.handle(request)
            keep = request.keep_alive and not response.close and not self._stop.is_set()
            try:
                send_response(sock, encode_head(response, keep, extra),
                              () if request.method == "HEAD" else response.chunks)
            except (OSError, ValueError):
                return False
            conn.last = time.monotonic()
            conn.started = None
            if not keep:
                return False


_LANDING_LINKS = (("metrics", "the Prometheus exposition"), ("guard", "the guard's verdict per rank, JSON"),
                  ("healthz", "liveness"), ("readyz", "readiness"))


def landing_page() -> bytes:
    """The page at ``/``, as exporters built on exporter-toolkit serve one (``web/landing_page.go``):
    the name, the version and a link to each endpoint. Behind the same auth as ``/metrics`` (there
    authentication wraps the whole handler, the landing page included). Links are relative, so they
    work behind a path prefix."""
    from kvguard import __version__  # noqa: PLC0415

    items = "\n".join(f'<li><a href="{path}">/{path}</a>: {text}</li>' for path, text in _LANDING_LINKS)
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>kvguard</title></head>\n"
            f"<body>\n<h1>kvguard</h1>\n<p>Allocator memory exporter and KV-cache OOM guard for LLM serving. "
            f"Version {__version__}.</p>\n<ul>\n{items}\n</ul>\n</body>\n</html>\n").encode()
