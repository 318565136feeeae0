"""The spool: one JSON snapshot per (host, pid, device), shared by probe and sidecar.

The probe writes ``<host>-<pid>-<device>.json`` by writing a temporary file whose name
does not end in ``.json`` and renaming it over the old one, so a reader sees either the
old snapshot or the new one, never half of one. Every regular file ending in ``.json``
is one rank's snapshot; anything else in the directory is ignored.

The reader treats the directory as hostile: files are opened without following links,
non-regular files are never opened, sizes are capped, and every rejected file is counted
under a reason instead of raising.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from kvguard.spool.schema import MAX_SNAPSHOT_BYTES, Snapshot, SnapshotError, decode_snapshot, snapshot_filename

MAX_SPOOL_FILES = 4096

# Reasons a spool file is skipped; exported as a label, so the set is fixed.
SKIP_REASONS = (
    "not_regular_file",
    "too_large",
    "unreadable",
    "invalid_json",
    "invalid_snapshot",
    "unsupported_schema",
    "too_many_files",
)


def own_pid_namespace() -> str:
    """This process's pid namespace as /proc names it (``pid:[4026531836]``), or "" without /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def write_snapshot(spool_dir: str, snapshot: Snapshot) -> str:
    """Atomically replace this rank's snapshot. Raises OSError on failure (the probe counts it).
    A snapshot of the writing process itself (the in-process probe's) records its pid namespace."""
    name = snapshot_filename(snapshot.host, snapshot.pid, snapshot.device)
    data = snapshot.to_dict()
    if snapshot.pid == os.getpid() and not snapshot.pid_namespace:
        data["pid_namespace"] = own_pid_namespace()
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    fd, tmp_path = tempfile.mkstemp(dir=spool_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; the sidecar usually runs as another (non-root) user.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.replace(tmp_path, os.path.join(spool_dir, name))
    except BaseException:
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        raise
    return name


# One read's budget, so its memory and time do not grow with what others write into the spool:
# directory entries looked at, files opened, and bytes read. Files past it wait (or are junk).
MAX_SPOOL_ENTRIES = 16384
MAX_SPOOL_READ_BYTES = 16 * 1024 * 1024
# A snapshot's written_at this far past the reader's clock is suspicious (the probe and the
# sidecar share a node's clock): clamped to when the reader first saw it, and counted.
FUTURE_TOLERANCE_SECONDS = 10.0
MAX_ERRORS = 64
# The probe's own file names (snapshot_filename); files named so are read first.
_PROBE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}-[0-9]{1,20}-[A-Za-z0-9_.-]{1,32}\.json\Z")


@dataclass
class SpoolRead:
    snapshots: list[Snapshot] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> files
    errors: list[str] = field(default_factory=list)  # "file: reason: message", for logs (at most MAX_ERRORS)
    listing_error: str | None = None  # why the directory itself could not be listed
    clamped: int = 0  # snapshots dated in the future, clamped

    def error(self, line: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(line)


def read_spool(
    spool_dir: str,
    max_bytes: int = MAX_SNAPSHOT_BYTES,
    max_files: int = MAX_SPOOL_FILES,
    max_total_bytes: int = MAX_SPOOL_READ_BYTES,
    max_entries: int = MAX_SPOOL_ENTRIES,
    now: float | None = None,
    first_seen: dict | None = None,
    known_junk: dict | None = None,
    known_good: set | None = None,
    waiting: dict | None = None,
) -> SpoolRead:
    """Read the ``*.json`` snapshots, newest first; never raises, only counts.

    Files that are not snapshots never hide snapshots, whatever their names and times. A file
    is known to be junk only once read, so the memo a caller keeps across reads decides the order:

    1. the names that were snapshots at the last read (``known_good``), even past ``max_entries``
       directory entries: they are charged to the snapshots' budget only (``max_files`` snapshots,
       ``max_total_bytes`` bytes), never to junk's;
    2. the names that waited at the last read because a budget ran out (``waiting``: name -> when
       it first waited), longest waiting first, so that no writer can starve a new rank;
    3. the names never seen;
    4. the names that were junk at the last read and have been replaced since.

    Within each group, files named as the probe names them first, then newest (mtime) first; an
    mtime more than FUTURE_TOLERANCE_SECONDS past ``now`` is not believed (the probe writes with
    the node's clock) and sorts after every believably dated one. Files that are not snapshots
    count toward neither ``max_files`` nor the snapshots' bytes, only toward a budget of their own
    (as many bytes again, so that the read's time stays bounded); once it is spent, only files
    not known to be snapshots wait (counted as ``too_many_files``) for a later read. A file
    found to be junk is remembered (``known_junk``: name -> (inode, size, reason), not its
    times, which any writer can set) and counted again without being read until it is replaced.
    ``max_bytes`` caps one file; at most ``max_entries`` directory entries are looked at.

    A ``written_at`` more than FUTURE_TOLERANCE_SECONDS past ``now`` is clamped to the time the
    reader first saw that snapshot (``first_seen``, kept by the caller across reads: then it ages
    and goes stale like any other), and counted in ``clamped``.
    """
    result = SpoolRead()
    now = time.time() if now is None else now
    latest_ns = int((now + FUTURE_TOLERANCE_SECONDS) * 1e9)
    good_before = known_good if known_good is not None else set()
    waited = waiting if waiting is not None else {}
    junk_before = known_junk if known_junk is not None else {}
    candidates = []
    junk: dict = {}
    over_entries = 0
    try:
        with os.scandir(spool_dir) as entries:
            for seen, entry in enumerate(entries):
                name = entry.name
                if seen >= max_entries and name not in good_before:
                    over_entries += 1
                    continue
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError as exc:
                    result.skipped["unreadable"] += 1
                    result.error(f"{name}: unreadable: {exc.strerror or exc}")
                    continue
                if not stat.S_ISREG(info.st_mode):
                    result.skipped["not_regular_file"] += 1
                    result.error(f"{name}: not_regular_file: not a regular file")
                    continue
                if info.st_size > max_bytes:
                    result.skipped["too_large"] += 1
                    result.error(f"{name}: too_large: {info.st_size} bytes exceeds {max_bytes}")
                    continue
                believable = info.st_mtime_ns <= latest_ns
                known = junk_before.get(name)
                if known is not None and known[:2] == (info.st_ino, info.st_size):
                    # Junk at the last read, and not replaced since (the probe renames a new file
                    # over the old one): counted as it was, not read again.
                    result.skipped[known[2]] += 1
                    junk[name] = known
                    continue
                if name in good_before:
                    order = (3, 0.0)
                elif name in waited:
                    order = (2, -waited[name])
                else:
                    order = (0 if known is not None else 1, 0.0)
                candidates.append(
                    order
                    + (
                        _PROBE_NAME.match(name) is not None,
                        believable,
                        info.st_mtime_ns if believable else 0,
                        name,
                        info.st_ino,
                        info.st_size,
                    )
                )
    except OSError as exc:
        result.listing_error = str(exc.strerror or exc)
        result.errors.append(f"{spool_dir}: {result.listing_error}")
        return result
    if over_entries:
        result.skipped["too_many_files"] += over_entries
        result.error(f"{spool_dir}: too_many_files: more than {max_entries} directory entries")
    candidates.sort(reverse=True)
    used = junk_used = 0
    clamped_keys: set = set()
    good: set = set()
    still_waiting: dict = {}
    over_files = False
    for tier, _, _, _, _, name, inode, size in candidates:
        was_good = tier == 3
        if len(result.snapshots) >= max_files:
            result.skipped["too_many_files"] += 1
            if not over_files:
                over_files = True
                result.error(f"{spool_dir}: too_many_files: {len(candidates)} files, {max_files} snapshots are read")
            _wait(name, was_good, good, still_waiting, waited, now)
            continue
        # A snapshot at the last read is charged to the snapshots' bytes only (the read as a whole
        # stays within twice the budget). Any other file may be junk (known only once read): the
        # smaller of what is left of the two budgets. A file longer than that waits for a later
        # read, and smaller ones still get theirs.
        left = max_total_bytes - used
        left = min(left, 2 * max_total_bytes - used - junk_used) if was_good else min(left, max_total_bytes - junk_used)
        if size > left:
            result.skipped["too_many_files"] += 1
            result.error(f"{name}: too_many_files: {max(0, left)} bytes are left of this read's budget for its {size}")
            _wait(name, was_good, good, still_waiting, waited, now)
            continue
        try:
            raw = _read_file(os.path.join(spool_dir, name), min(max_bytes, left), max_bytes)
            if raw is None:  # grew past what is left since it was listed
                result.skipped["too_many_files"] += 1
                result.error(f"{name}: too_many_files: this read's {max_total_bytes} bytes are used up")
                _wait(name, was_good, good, still_waiting, waited, now)
                continue
            snapshot = decode_snapshot(raw)
        except SnapshotError as exc:
            result.skipped[exc.reason] += 1
            result.error(f"{name}: {exc.reason}: {exc}")
            junk[name] = (inode, size, exc.reason)
            junk_used += size
            continue
        used += len(raw)
        good.add(name)
        if snapshot.written_at > now + FUTURE_TOLERANCE_SECONDS:
            key = (name, snapshot.written_at, snapshot.sequence)
            clamped_keys.add(key)
            seen_at = now if first_seen is None else first_seen.setdefault(key, now)
            snapshot = replace(snapshot, written_at=seen_at, clamped_from=snapshot.written_at)
            result.clamped += 1
        result.snapshots.append(snapshot)
    if first_seen is not None:  # forget what is gone, so the memo stays as small as the spool
        for key in set(first_seen) - clamped_keys:
            del first_seen[key]
    # The memos hold what this read saw: what is gone, was replaced or changed group is forgotten.
    if known_junk is not None:
        known_junk.clear()
        known_junk.update(junk)
    if known_good is not None:
        known_good.clear()
        known_good.update(good)
    if waiting is not None:
        waiting.clear()
        waiting.update(still_waiting)
    return result


def _wait(name: str, was_good: bool, good: set, still_waiting: dict, waited: dict, now: float) -> None:
    """A file left for a later read: a snapshot at the last read stays known as one (it is read
    first again); any other waits, and keeps the time it first waited."""
    if was_good:
        good.add(name)
    else:
        still_waiting[name] = waited.get(name, now)


class SpoolReader:
    """Reads one spool again and again, remembering when it first saw each future-dated snapshot,
    which files were snapshots, which were junk, and which wait for a budget (read_spool)."""

    def __init__(self, spool_dir: str, **limits: Any):
        self.spool_dir = spool_dir
        self.limits = limits
        self._first_seen: dict = {}
        self._known_junk: dict = {}
        self._known_good: set = set()
        self._waiting: dict = {}

    def read(self) -> SpoolRead:
        return read_spool(
            self.spool_dir,
            first_seen=self._first_seen,
            known_junk=self._known_junk,
            known_good=self._known_good,
            waiting=self._waiting,
            **self.limits,
        )


def _read_file(path: str, limit: int, max_bytes: int) -> bytes | None:
    """A regular file's bytes, opened without following links. None when it is longer than
    ``limit`` < ``max_bytes`` (the read's budget ran out, not the file's own cap)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise SnapshotError("unreadable", exc.strerror or str(exc)) from None
    if not stat.S_ISREG(info.st_mode):
        raise SnapshotError("not_regular_file", "not a regular file")
    if info.st_size > max_bytes:
        raise SnapshotError("too_large", f"{info.st_size} bytes exceeds {max_bytes}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise SnapshotError("not_regular_file", "not a regular file")
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise SnapshotError("unreadable", exc.strerror or str(exc)) from None
    if len(raw) > limit:
        if limit < max_bytes:
            return None
        raise SnapshotError("too_large", f"more than {max_bytes} bytes")
    return raw
