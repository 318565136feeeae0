"""The host source: psutil's system memory and the serving process's RSS."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from kvguard.sources import SourceError, get_source
from kvguard.sources.host import HostSource


def test_host_reports_system_memory():
    [record] = get_source("host").sample()
    assert record.device == "host"
    assert record.total_bytes == psutil.virtual_memory().total
    assert record.used_bytes == record.total_bytes - record.free_bytes


def test_host_reports_this_process_rss_by_default():
    [record] = HostSource().sample()
    assert [p.pid for p in record.processes] == [os.getpid()]
    assert record.process_used_bytes == record.processes[0].used_bytes > 0


def test_host_reports_a_given_process():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        [record] = HostSource(pid=child.pid).sample()
        assert record.processes[0].pid == child.pid
    finally:
        child.communicate(b"")


def test_a_process_that_is_gone_leaves_the_host_totals():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    [record] = HostSource(pid=child.pid).sample()
    assert record.process_used_bytes is None
    assert record.total_bytes > 0


def test_bad_pid_option_is_a_one_line_error():
    with pytest.raises(SourceError, match="pid must be a positive integer"):
        HostSource(pid=0)
