"""Drive kvguard's MindSpore pool oracle (ms_pool_oracle.cc) from Python: one client for the differential
tests (tests/upstream/test_oracle_mindspore.py) and the guard grids' real-pool truth (bench/real_pool.py).

A one-stream run of the oracle spends ~0.35 s loading MindSpore's libraries, more than a serving run's
whole stream takes. So each release gets one long-lived oracle in serve mode (KVGUARD_ORACLE_SERVE=1):
it loads the libraries once and runs every stream in a child forked before any pool exists, so each
stream still meets a fresh ``DefaultAscendMemoryPool``, exactly as a one-stream run does
(tests/upstream/test_oracle_mindspore.py checks the two agree).

    init, records = replay("2.7.1", ops, free=64 << 30, vmm=True, task_sink=True, compiled_at=[120])

``ops`` are ``kvguard.allocators.ops.Op``; ``compiled_at``: op positions a jit_level O0 compile came before
(``Recorder.compiled_at``), sent as the harness's context line ``{"op": "jit_o0_compile"}``.
"""

from __future__ import annotations

import atexit
import importlib.util
import io
import json
import os
import pathlib
import select
import subprocess
import tempfile
import time
from typing import Iterable

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("mindspore_oracle_build", HERE / "build.py")
oracle_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle_build)

COMPILE_LINE = '{"op": "jit_o0_compile"}'


class OracleError(RuntimeError):
    """The oracle is missing, or a stream did not run to its end (one line)."""


class Server:
    """One release's oracle in serve mode."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, "KVGUARD_ORACLE_SERVE": "1"},
        )

    def run(self, lines: list[str], env: dict[str, str], timeout: float = 600) -> list[str]:
        """The stream's output lines (its init line first). ``env``: the stream's environment, as a
        one-stream run would have it (a variable not named is unset)."""
        if self._proc.poll() is not None:
            raise OracleError(f"oracle {self.path} exited {self._proc.returncode}")
        self._stderr.seek(0)
        self._stderr.truncate()
        header = json.dumps({"stream": len(lines), **{k: str(v) for k, v in env.items()}})
        self._proc.stdin.write(("\n".join([header, *lines]) + "\n").encode())
        self._proc.stdin.flush()
        out = self._read_stream(time.monotonic() + timeout)
        status = json.loads(out.pop())["end"]
        if status != 0:
            raise OracleError(
                f"oracle {self.path} stream ended with wait status {status} after "
                f"{max(len(out) - 1, 0)} of {len(lines)} lines: {self.stderr_tail()}"
            )
        return out

    def _read_stream(self, deadline: float) -> list[str]:
        """Every line up to and including the {"end": ...} line (the server writes nothing after it)."""
        fd = self._proc.stdout.fileno()
        chunks: list[bytes] = []
        tail = b"\n"  # the end of what was read so far: the marker may straddle two chunks
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                raise OracleError(f"oracle {self.path} gave no answer in time")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise OracleError(f"oracle {self.path} exited mid-stream: {self.stderr_tail()}")
            chunks.append(chunk)
            window = tail + chunk
            at = window.rfind(b'\n{"end":')
            if at >= 0 and window.endswith(b"\n") and window.find(b"\n", at + 1) == len(window) - 1:
                return b"".join(chunks).decode().splitlines()
            tail = window[-16:]

    def stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()[-300:]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


_servers: dict[str, Server] = {}


def server(version: str) -> Server:
    """The running oracle for ``version`` (started on first use, closed at exit)."""
    if version not in _servers or _servers[version]._proc.poll() is not None:
        path = oracle_build.oracle_path(version)
        if path is None:
            why = oracle_build.failure(version) or "not built"
            raise OracleError(
                f"MindSpore {version} pool oracle: {why}: run ./dev.sh test "
                f"(or python3 tests/upstream/oracles/mindspore/build.py {version})"
            )
        _servers[version] = Server(path)
    return _servers[version]


@atexit.register
def _close_all() -> None:
    for running in _servers.values():
        running.close()


def stream_lines(ops: list, compiled_at: Iterable[int] = ()) -> list[str]:
    """The harness's input: the ops as ``kvguard simulate --ops`` lines, with the compile line before
    each position in ``compiled_at``."""
    from kvguard.allocators.ops import write_ops

    stream = io.StringIO()
    start = 0
    for position in sorted(compiled_at):
        write_ops(ops[start:position], stream)
        stream.write(COMPILE_LINE + "\n")
        start = position
    write_ops(ops[start:], stream)
    return stream.getvalue().splitlines()


def replay(
    version: str,
    ops: list,
    *,
    free: int,
    vmm: bool,
    task_sink: bool | None = None,
    compiled_at: Iterable[int] = (),
    compact: bool = False,
    total: int | None = None,
    mempool_block_gb: float | None = None,
    timeout: float = 600,
) -> tuple[dict, list[dict]]:
    """The real pool's init record and one record per op. ``task_sink`` None keeps MindSpore's default;
    ``mempool_block_gb``: ``set_context(mempool_block_size=)`` in GB (None: MindSpore's default, 1.0).
    ``compact``: per op only oom, reserved_bytes, allocated_bytes and address (long streams); else every
    field the harness prints."""
    env = {"KVGUARD_ORACLE_DEVICE_FREE": free, "MS_ALLOC_CONF": f"enable_vmm:{'true' if vmm else 'false'}"}
    if task_sink is not None:
        env["KVGUARD_ORACLE_TASK_SINK"] = int(task_sink)
    if total is not None:
        env["KVGUARD_ORACLE_DEVICE_TOTAL"] = total
    if mempool_block_gb is not None:
        env["KVGUARD_ORACLE_MEMPOOL_BLOCK_GB"] = mempool_block_gb
    if compact:
        env["KVGUARD_ORACLE_OUTPUT"] = "compact"
    lines = server(version).run(stream_lines(ops, compiled_at), env, timeout)
    if len(lines) != len(ops) + 1:
        raise OracleError(f"MindSpore {version} oracle answered {len(lines) - 1} of {len(ops)} ops")
    records = []
    for line in lines[1:]:
        if compact:
            if line.startswith("error"):
                raise OracleError(f"the real pool raised at op {line[6:300]}")
            oom, reserved, allocated, address = map(int, line.split())
            records.append(
                {"oom": bool(oom), "reserved_bytes": reserved, "allocated_bytes": allocated, "address": address or None}
            )
        else:
            record = json.loads(line)
            if "error" in record:
                raise OracleError(f"the real pool raised at op {record['step']}: {record['error'][:200]}")
            records.append(record)
    return json.loads(lines[0])["init"], records
