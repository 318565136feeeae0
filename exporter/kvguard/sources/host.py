"""Host memory through psutil: the machine's RAM and the serving process's resident set.

Reported under ``device="host"``: total, available (as free) and used (total − available),
and the serving process's RSS as ``process_used_bytes`` (this process unless a pid is given).
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.records import DeviceMemory, ProcessMemory
from kvguard.sources import SourceError, free_total_used
from kvguard.text import one_line


class HostSource:
    name = "host"

    def __init__(self, pid: int | None = None, psutil_module: Any = None):
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
            raise SourceError(f"host source pid must be a positive integer, got {pid!r}")
        self._pid = pid
        self._psutil = psutil_module

    def sample(self) -> list[DeviceMemory]:
        psutil = self._psutil
        if psutil is None:
            import psutil  # noqa: PLC0415 - a dependency of kvguard, imported when used

            self._psutil = psutil
        try:
            memory = psutil.virtual_memory()
        except Exception as exc:  # noqa: BLE001 - psutil raises OSError/RuntimeError alike
            raise SourceError(f"host: {one_line(exc)}") from None
        pid = self._pid or os.getpid()
        processes: tuple[ProcessMemory, ...] = ()
        rss = None
        try:
            process = psutil.Process(pid)
            rss = int(process.memory_info().rss)
            processes = (ProcessMemory(pid=pid, used_bytes=rss, name=process.name()[:128]),)
        except Exception:  # noqa: BLE001 - the process may have exited; the host totals still count
            pass
        return [
            DeviceMemory(
                device="host",
                source=self.name,
                process_used_bytes=rss,
                processes=processes,
                **free_total_used(memory.available, memory.total),
            )
        ]
