"""Bounded reads: a slow or hung source never holds up a scrape.

A Poller runs one read at a time in a daemon thread. ``refresh(wait)`` starts a read if none
is in flight and waits at most ``wait`` seconds for it; ``wait(seconds)`` only waits for the
read in flight, starting none. A read still running after ``timeout``
counts as an error and the last good value keeps being served, marked with its age; when the late
read does finish without error, its value is served from then on (the source stays down). A hung
read occupies one thread, never more: no new read starts until it returns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvguard.text import one_line


@dataclass(frozen=True)
class PollState:
    name: str
    value: Any = None  # the last good value (None before the first success)
    success_at: float | None = None  # monotonic time of the last good read
    up: bool = False  # the last read finished in time and without error
    errors_total: int = 0
    duration_seconds: float | None = None
    last_error: str | None = None

    def age_seconds(self) -> float | None:
        if self.success_at is None:
            return None
        return max(0.0, time.monotonic() - self.success_at)


class Poller:
    def __init__(self, name: str, read: Callable[[], Any], timeout: float):
        self.name = name
        self._read = read
        self.timeout = timeout
        self._lock = threading.Lock()
        self._state = PollState(name)
        self._in_flight: threading.Event | None = None
        self._started_at = 0.0
        self._timed_out = False
        self.generation = 0  # bumped whenever the state changes

    @property
    def state(self) -> PollState:
        with self._lock:
            self._note_overrun()
            return self._state

    def refresh(self, wait: float) -> None:
        """Start a read if none is in flight, then wait at most ``wait`` seconds for it."""
        with self._lock:
            self._note_overrun()
            if self._in_flight is None:
                done = threading.Event()
                self._in_flight = done
                self._started_at = time.monotonic()
                self._timed_out = False
                threading.Thread(target=self._run, args=(done,), name=f"kvguard-read-{self.name}", daemon=True).start()
        self.wait(wait)

    def wait(self, seconds: float) -> None:
        """Wait at most ``seconds`` (never past its time limit) for the read in flight; start none."""
        with self._lock:
            done = self._in_flight
            remaining = self._started_at + self.timeout - time.monotonic()
        if done is not None:
            done.wait(max(0.0, min(seconds, remaining)))

    def _run(self, done: threading.Event) -> None:
        started = time.monotonic()
        try:
            value, error = self._read(), None
        except BaseException as exc:  # noqa: BLE001 - a source's failure (SystemExit too, it is a daemon
            # thread's) is counted and shown, never raised into a scrape or onto the host's stderr
            value, error = None, one_line(exc)
        finished = time.monotonic()
        with self._lock:
            late = self._timed_out or finished - started > self.timeout
            state = self._state
            if error is None and not late:
                self._state = PollState(self.name, value, finished, True, state.errors_total, finished - started)
            elif error is None:
                # Late but good: serve it (with its age) rather than never yielding a value from a source
                # that is always slower than the limit; the overrun is counted and the source shows down.
                counted = 0 if self._timed_out else 1
                self._state = PollState(
                    self.name,
                    value,
                    finished,
                    False,
                    state.errors_total + counted,
                    finished - started,
                    f"read took {finished - started:.1f}s, over the {self.timeout:g}s limit",
                )
            else:
                counted = 0 if self._timed_out else 1  # an overrun was already counted when noticed
                message = error or f"read took {finished - started:.1f}s, over the {self.timeout:g}s limit"
                self._state = PollState(
                    self.name,
                    state.value,
                    state.success_at,
                    False,
                    state.errors_total + counted,
                    finished - started,
                    message,
                )
            self.generation += 1
            self._in_flight = None
            done.set()

    def _note_overrun(self) -> None:
        """Count a read that is still running past its limit, once, as soon as anyone looks."""
        if self._in_flight is not None and not self._timed_out and time.monotonic() - self._started_at > self.timeout:
            self._timed_out = True
            state = self._state
            self._state = PollState(
                self.name,
                state.value,
                state.success_at,
                False,
                state.errors_total + 1,
                state.duration_seconds,
                f"read still running after {self.timeout:g}s",
            )
            self.generation += 1
