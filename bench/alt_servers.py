"""kvguard's application behind two well-kept server libraries, for bench/bench_attacks.py (issue 23:
"measure the current server against a well-kept server library on the same attacks").

Both serve the same application object the hand-written server serves
(kvguard.sidecar.server.Application over kvguard.sidecar.exposition.Exposition and the sidecar
reading the spool): the same endpoints and bodies (/metrics made once per refresh, /healthz,
/readyz, /guard), the same basic-auth check from the exporter-toolkit web config
(kvguard.sidecar.webconfig: credentials bcrypt has accepted are answered from its cache, others
limited per source address, 429 beyond). Only the HTTP layer differs:

- ``h11``: an asyncio server (``asyncio.start_server``, one coroutine per connection) speaking
  HTTP/1.1 through h11 0.16.0. A /metrics or /guard build runs in a pool of 4 threads (the
  hand-written server's ``workers``), bcrypt in a pool of 1 (its ``auth_workers``; the waiting
  line is the executor's, unbounded but one request per connection at most, where the
  hand-written server answers 429 past ``auth_queue``); a wrong password or a 429 is answered
  ``auth_failure_delay`` late with ``asyncio.sleep`` (the connection not read meanwhile, as there). A request head
  must arrive within 10 s of the wait
  for it (the hand-written server's ``header_timeout``), an answer must drain within 30 s
  (its ``request_timeout``); the body is handed to the transport as the shared chunks.
- ``cheroot``: cheroot 11.1.2's WSGI server (CherryPy's), with its defaults (10 worker
  threads, each request answered whole by one thread, keep-alive connections waiting in its
  selector between requests) but a listen backlog of 1024 as the hand-written server's (its
  default, 5, drops SYNs under the 400 slowloris connections) and the same 32 KiB head cap. A
  WSGI application can only delay an answer by holding a worker thread, so here a wrong
  password or a 429 is answered at once; bcrypt runs in the request's thread.

Bench-only dependencies, not in the test install (nothing under tests/ imports this)::

    .venv/bin/pip install h11==0.16.0 cheroot==11.1.2

    python bench/alt_servers.py {h11,cheroot} --port PORT --spool-dir DIR [--interval 5]
        [--web.config.file FILE]

It answers on 127.0.0.1 until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "exporter"))

from kvguard.sidecar.core import Sidecar, SidecarConfig  # noqa: E402
from kvguard.sidecar.exposition import Exposition  # noqa: E402
from kvguard.sidecar.server import (
    _REASONS,
    _UNAUTHORIZED,
    BUILD,
    Application,
    Request,
    Response,  # noqa: E402
    ServerOptions,
    Verify,
    _text,
)
from kvguard.sidecar.webconfig import WebConfigWatcher  # noqa: E402

OPTIONS = ServerOptions(listen="127.0.0.1")
HEADER_TIMEOUT = OPTIONS.header_timeout
WRITE_TIMEOUT = OPTIONS.request_timeout
MAX_HEAD = OPTIONS.max_header_bytes
LISTEN_BACKLOG = 1024


def application(
    spool_dir: str, interval: float, web_config_file: str | None
) -> tuple[Application, WebConfigWatcher | None]:
    """The hand-written server's application over a started sidecar (kvguard.cli.serve's setup,
    --source none)."""
    sidecar = Sidecar(SidecarConfig(spool_dir=spool_dir, sources=(), interval=interval))
    watcher = WebConfigWatcher(web_config_file) if web_config_file else None
    exposition = Exposition(sidecar)
    app = Application(sidecar, OPTIONS, exposition, watcher.current if watcher is not None else None)
    sidecar.start()
    return app, watcher


def response_headers(app_response: Response, extra: dict[str, str], server: str) -> list[tuple[str, str]]:
    headers = [
        ("Server", server),
        ("Content-Type", app_response.content_type),
        ("Content-Length", str(app_response.length)),
    ]
    headers += list({**extra, **app_response.headers}.items())
    if app_response.close:
        headers.append(("Connection", "close"))
    return headers


def unauthorized(options: ServerOptions, delay: bool) -> Response:
    return _text(401, "unauthorized\n", headers=dict(_UNAUTHORIZED), delay=options.auth_failure_delay if delay else 0)


# ------------------------------------------------------------------------------ asyncio + h11


def serve_h11(port: int, app: Application, watcher: WebConfigWatcher | None) -> None:
    import h11

    builders = ThreadPoolExecutor(max_workers=OPTIONS.workers, thread_name_prefix="build")
    bcrypt_pool = ThreadPoolExecutor(max_workers=OPTIONS.auth_workers, thread_name_prefix="bcrypt")

    async def next_event(conn, reader: asyncio.StreamReader):
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await reader.read(65536))

    async def answer(request: Request, source: str) -> Response:
        loop = asyncio.get_running_loop()
        outcome = app.route(request, source)
        if isinstance(outcome, Verify):
            ok = await loop.run_in_executor(
                bcrypt_pool, app.basic_auth.verify, outcome.users, outcome.user, outcome.password
            )
            outcome = BUILD if ok else unauthorized(OPTIONS, delay=True)
        if outcome == BUILD:
            outcome = await loop.run_in_executor(builders, app.build, request)
        if outcome.delay > 0:
            await asyncio.sleep(outcome.delay)
        return outcome

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        try:
            while True:
                try:
                    event = await asyncio.wait_for(next_event(conn, reader), HEADER_TIMEOUT)
                except h11.RemoteProtocolError as exc:
                    if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                        status = exc.error_status_hint
                        body = f"{exc}\n".encode()
                        writer.write(
                            conn.send(
                                h11.Response(
                                    status_code=status,
                                    headers=[("Content-Length", str(len(body))), ("Connection", "close")],
                                )
                            )
                        )
                        writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
                    return
                if not isinstance(event, h11.Request):  # ConnectionClosed, or a peer gone mid-head
                    return
                headers: dict[str, str] = {}
                for name, value in event.headers:
                    key = name.decode("latin-1").lower()
                    text = value.decode("latin-1")
                    headers[key] = headers[key] + ", " + text if key in headers else text
                version = "HTTP/1.0" if event.http_version == b"1.0" else "HTTP/1.1"
                request = Request(
                    event.method.decode("latin-1"),
                    event.target.decode("latin-1"),
                    version,
                    headers,
                    True,
                    "content-length" in headers or "transfer-encoding" in headers,
                )
                response = await answer(request, source)
                extra = watcher.current().headers if watcher is not None else {}
                writer.writelines(
                    conn.send_with_data_passthrough(
                        h11.Response(
                            status_code=response.status,
                            reason=_REASONS.get(response.status, "Error").encode(),
                            headers=response_headers(response, extra, "kvguard-h11"),
                        )
                    )
                )
                if request.method != "HEAD":
                    for chunk in response.chunks:  # the shared chunks, not joined per scrape
                        if chunk:
                            writer.writelines(conn.send_with_data_passthrough(h11.Data(data=chunk)))
                writer.writelines(conn.send_with_data_passthrough(h11.EndOfMessage()))
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
                if conn.our_state is h11.MUST_CLOSE or request.has_body:
                    return
                while conn.their_state is not h11.DONE:  # the request's EndOfMessage, there already
                    if isinstance(
                        await asyncio.wait_for(next_event(conn, reader), HEADER_TIMEOUT), h11.ConnectionClosed
                    ):
                        return
                conn.start_next_cycle()
        except (asyncio.TimeoutError, OSError, h11.LocalProtocolError, h11.RemoteProtocolError):
            return
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=LISTEN_BACKLOG, limit=MAX_HEAD)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ------------------------------------------------------------------------------ cheroot (WSGI)


def serve_cheroot(port: int, app: Application, watcher: WebConfigWatcher | None) -> None:
    from cheroot import wsgi

    route_lock = threading.Lock()  # Application.route runs in one thread in the hand-written server

    def wsgi_app(environ, start_response):
        headers = {
            key[5:].lower().replace("_", "-"): value for key, value in environ.items() if key.startswith("HTTP_")
        }
        for key in ("CONTENT_LENGTH", "CONTENT_TYPE"):
            if environ.get(key):
                headers[key.lower().replace("_", "-")] = environ[key]
        target = environ.get("PATH_INFO", "/") + ("?" + environ["QUERY_STRING"] if environ.get("QUERY_STRING") else "")
        request = Request(
            environ["REQUEST_METHOD"], target, environ.get("SERVER_PROTOCOL", "HTTP/1.1"), headers, True, False
        )
        with route_lock:
            outcome = app.route(request, environ.get("REMOTE_ADDR", ""))
        if isinstance(outcome, Verify):
            ok = app.basic_auth.verify(outcome.users, outcome.user, outcome.password)
            outcome = BUILD if ok else unauthorized(OPTIONS, delay=False)
        response = app.build(request) if outcome == BUILD else outcome  # a delay is not held: see the docstring
        extra = watcher.current().headers if watcher is not None else {}
        start_response(
            f"{response.status} {_REASONS.get(response.status, 'Error')}",
            [(k, v) for k, v in response_headers(response, extra, "kvguard-cheroot") if k != "Server"],
        )
        return [chunk for chunk in response.chunks if chunk]

    server = wsgi.Server(("127.0.0.1", port), wsgi_app, request_queue_size=LISTEN_BACKLOG, timeout=HEADER_TIMEOUT)
    server.max_request_header_size = MAX_HEAD
    server.safe_start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("server", choices=("h11", "cheroot"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spool-dir", required=True)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--web.config.file", dest="web_config_file")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard), hard))
    app, watcher = application(args.spool_dir, args.interval, args.web_config_file)
    (serve_h11 if args.server == "h11" else serve_cheroot)(args.port, app, watcher)


if __name__ == "__main__":
    main()
