"""Helpers shared by the tests, one copy each (issue 22, item 5): run the command line in-process or as
``python -m kvguard``, and read its one-line error; bound a call that may hang; serve a loopback HTTP
endpoint. Real-shaped snapshots: :mod:`sidecar_fixtures`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

from click.testing import CliRunner, Result

T = TypeVar("T")


def within(seconds: float, call: Callable[[], T], what: str) -> T:
    """``call()`` in a thread: what it returns, or what it raises, raised here. A call that hangs fails the
    test (``what`` names it) instead of hanging it."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test's thread as it is
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=seconds)
    assert not runner.is_alive(), f"{what} did not return within {seconds:g}s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def invoke(*args: str, seconds: float | None = None) -> Result:
    """``kvguard ARGS`` in-process (click's CliRunner; an exception lands in ``result.exception``).

    With ``seconds``, the command runs in a thread: one that hangs fails the test instead of hanging it.
    """
    from kvguard.cli import main

    if seconds is None:
        return CliRunner().invoke(main, list(args))
    return within(seconds, lambda: CliRunner().invoke(main, list(args)), f"kvguard {' '.join(args)}")


def kvguard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m kvguard ARGS`` as its own process, as a user runs it (no KVGUARD_DEBUG tracebacks)."""
    return subprocess.run(
        [sys.executable, "-m", "kvguard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "KVGUARD_DEBUG": ""},
    )


def one_line_error(result: Result | subprocess.CompletedProcess, code: int = 65) -> str:
    """The one line a failed command printed, after checking it exited ``code`` without a traceback.

    A click ``Result`` prints on its output, a ``CompletedProcess`` on stderr. Click's usage header for a
    usage error (``Usage: ...``, ``Try '... -h' for help.``) is not part of the error.
    """
    if isinstance(result, subprocess.CompletedProcess):
        exit_code, output, exception = result.returncode, result.stderr, None
    else:
        exit_code, output, exception = result.exit_code, result.output, result.exception
    assert exit_code == code, output
    assert exception is None or isinstance(exception, SystemExit), repr(exception)
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith(("Usage: ", "Try '"))]
    assert len(lines) == 1, output
    return lines[0]


def wait_for(condition: Callable[[], bool], seconds: float = 20.0) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; its last value."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def reply(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str | None = None) -> None:
    """A whole answer: status, headers with the body's length, the body."""
    request.send_response(status)
    if content_type is not None:
        request.send_header("Content-Type", content_type)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


class LoopbackHTTP:
    """An HTTP server on a free loopback port whose GET is ``answer(request)``, one thread a request.

    ``target`` is its host:port (a Prometheus scrape target), ``url`` its /metrics.
    """

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler], None]):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                answer(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.target = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"http://{self.target}/metrics"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def cli_args(command: str, *args) -> list[str]:
    """``args`` as a command line of ``kvguard COMMAND``, a figure in bytes after a SIZE option written with its
    unit (``1234B``): a SIZE refuses a bare number."""
    import click

    from kvguard.cli import main
    from kvguard.cli.options import SizeType

    sizes = {
        flag
        for p in main.commands[command].params
        if isinstance(p, click.Option) and isinstance(p.type, SizeType)
        for flag in p.opts
    }
    out: list[str] = []
    for arg in args:
        after_size = bool(out) and out[-1] in sizes
        out.append(f"{arg}B" if after_size and isinstance(arg, int) and not isinstance(arg, bool) else str(arg))
    return out
