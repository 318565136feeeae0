"""The sidecar's HTTP endpoints: /metrics, /healthz, /readyz, /guard; 404 for anything else.

A threaded stdlib server (one thread per connection, each with a socket timeout), so a slow
client cannot hold up a scrape. Exposition comes from client_python: ``choose_encoder`` picks
Prometheus text or OpenMetrics from ``Accept``; the body is gzipped when ``Accept-Encoding``
allows. TLS and HTTP basic auth are options; the probes (/healthz, /readyz) stay open so the
kubelet can reach them without credentials.
"""

from __future__ import annotations

import base64
import gzip
import hmac
import json
import socket
import ssl
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector

from kvguard.collector import KVGuardCollector
from kvguard.guard import CRITICAL
from kvguard.sidecar import Sidecar

OPEN_PATHS = ("/healthz", "/readyz")


@dataclass(frozen=True)
class ServerOptions:
    listen: str = "0.0.0.0"
    port: int = 10240
    fail_readiness_on_critical: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    basic_auth_user: str | None = None
    basic_auth_password: str | None = None
    request_timeout: float = 30.0


def make_tls_context(options: ServerOptions) -> ssl.SSLContext | None:
    """The server's TLS context, or None without TLS. Raises OSError or ssl.SSLError on a bad cert or key."""
    if not options.tls_cert_file:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(options.tls_cert_file, options.tls_key_file)
    return context


def make_registry(sidecar: Sidecar) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVGuardCollector(sidecar))
    ProcessCollector(registry=registry)
    return registry


def _gzip_accepted(header: str | None) -> bool:
    return any(part.split(";")[0].strip().lower() == "gzip" for part in (header or "").split(","))


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvguard"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    # Set per server class in make_server.
    sidecar: Sidecar
    registry: CollectorRegistry
    options: ServerOptions

    def setup(self) -> None:
        self.timeout = self.options.request_timeout
        super().setup()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # one line per scrape is noise; errors surface in the metrics and /guard

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _other(self) -> None:
        self._send(405, b"method not allowed\n", "text/plain; charset=utf-8", extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other

    def _dispatch(self, head: bool) -> None:
        path = urlsplit(self.path).path
        self._head = head
        if path not in OPEN_PATHS and not self._authorized():
            self._send(401, b"unauthorized\n", "text/plain; charset=utf-8",
                       extra={"WWW-Authenticate": 'Basic realm="kvguard", charset="UTF-8"'})
            return
        try:
            if path == "/metrics":
                self._metrics()
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain; charset=utf-8")
            elif path == "/readyz":
                self._readyz()
            elif path == "/guard":
                body = json.dumps(self.sidecar.observe().guard_dict(), indent=2).encode() + b"\n"
                self._send(200, body, "application/json")
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as exc:  # one line to the client, never a traceback
            message = (str(exc).splitlines() or [type(exc).__name__])[0]
            self._send(500, f"error: {message}\n".encode(), "text/plain; charset=utf-8")

    def _authorized(self) -> bool:
        user, password = self.options.basic_auth_user, self.options.basic_auth_password
        if user is None:
            return True
        header = self.headers.get("Authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given_user, _, given_password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8") \
                .partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        # Compare both, always, in constant time.
        ok_user = hmac.compare_digest(given_user.encode(), user.encode())
        ok_password = hmac.compare_digest(given_password.encode(), (password or "").encode())
        return ok_user and ok_password

    def _metrics(self) -> None:
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        body = encoder(self.registry)
        extra = {}
        if _gzip_accepted(self.headers.get("Accept-Encoding")):
            body = gzip.compress(body)
            extra["Content-Encoding"] = "gzip"
        self._send(200, body, content_type, extra=extra)

    def _readyz(self) -> None:
        if self.options.fail_readiness_on_critical:
            observation = self.sidecar.observe()
            if observation.state == CRITICAL:
                critical = [r for r in observation.ranks if r.verdict.state == CRITICAL]
                lines = [f"critical: rank {r.labels['rank'] or '-'} device {r.labels['device'] or '-'}: "
                         f"{'; '.join(reason.code for reason in r.verdict.reasons)}" for r in critical]
                self._send(503, ("\n".join(lines) + "\n").encode(), "text/plain; charset=utf-8")
                return
        self._send(200, b"ready\n", "text/plain; charset=utf-8")

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not getattr(self, "_head", False):
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    connection_errors_total = 0

    def handle_error(self, request, client_address) -> None:
        """One line per failed connection (plain HTTP on the TLS port, a reset), never a traceback."""
        error = sys.exc_info()[1]
        self.connection_errors_total += 1
        message = (str(error).splitlines() or [""])[0] or type(error).__name__
        host = client_address[0] if isinstance(client_address, tuple) and client_address else client_address
        print(f"kvguard serve: connection from {host}: {message[:200]}", file=sys.stderr, flush=True)


class KVGuardServer:
    """The HTTP server and its thread; ``start()`` returns once the socket listens."""

    def __init__(self, sidecar: Sidecar, options: ServerOptions, registry: CollectorRegistry | None = None,
                 tls_context: ssl.SSLContext | None = None):
        self.options = options
        handler = type("KVGuardHandler", (_Handler,), {
            "sidecar": sidecar, "registry": registry or make_registry(sidecar), "options": options})
        server_class = _Server
        if ":" in options.listen:
            server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        # Load the certificate before binding: a bad path is a TLS error, not a listen error.
        context = tls_context or make_tls_context(options)
        self.httpd = server_class((options.listen, options.port), handler)
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True,
                                                    do_handshake_on_connect=False)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def scheme(self) -> str:
        return "https" if self.options.tls_cert_file else "http"

    def url(self, path: str = "/", host: str | None = None) -> str:
        host = host or self.options.listen
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1" if host != "::" else "[::1]"
        elif ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}{path}"

    def start(self) -> "KVGuardServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kvguard-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.5)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join(timeout=5)
