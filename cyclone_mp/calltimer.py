"""A timer thread that cuts short a database call that outlives its bound: it shuts the
call's socket down (both ways, its descriptor left to the driver), so the waiting call
fails at once. One thread per process (:data:`CALL_TIMER`); arming and disarming a call
takes a lock and, rarely, a wake-up.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
from typing import Any, Iterator


class Bound:
    """One call armed on a :class:`CallTimer`: ``fired`` turns True when its socket was shut down."""

    __slots__ = ("fd", "fired")

    def __init__(self, fd: int) -> None:
        self.fd, self.fired = fd, False


class CallTimer:
    """Shuts down the socket of a call that outlives its bound (one thread per process).

    ``with timer.bound(store, seconds): store.method(...)`` arms a timer for the call
    (``store``: a :class:`~cyclone_mp.store.Store`, or a sync or async driver
    connection); leaving the block disarms it. A shut-down socket makes the driver raise at
    once, which the store reports as :class:`~cyclone_mp.errors.DatabaseUnavailable`;
    the block's :class:`Bound` says whether it was this timer.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, int]] = []
        self._armed: dict[int, Bound] = {}  # token -> the call's socket
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired = 0  # calls cut short (for tests and stats)

    @contextlib.contextmanager
    def bound(self, store: Any, seconds: float) -> Iterator[Bound]:
        """Bound the calls made on ``store`` inside the block to ``seconds``."""
        try:
            fd = getattr(store, "conn", store).pgconn.socket
        except Exception:  # noqa: BLE001 - a closed connection: the call fails on its own
            yield Bound(-1)
            return
        token = next(self._tokens)
        due = time.monotonic() + seconds
        armed = Bound(fd)
        with self._lock:
            self._armed[token] = armed
            # The timer thread sleeps until the heap's first entry is due (armed or not): it
            # needs waking only for a call due before that. A part's calls share one bound,
            # so on the hot path (a statement per batch) a call is rarely due first and wakes
            # no thread; finished calls stay in the heap until the first is due (about calls
            # per second x bound entries), then go in one pass.
            earlier = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, token, fd))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cyclone-call-timer", daemon=True)
                self._thread.start()
            if earlier:
                self._lock.notify()
        try:
            yield armed
        finally:
            with self._lock:
                self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # disarmed
                if not self._heap:
                    self._lock.wait()
                    continue
                due, token, fd = self._heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                heapq.heappop(self._heap)
                armed = self._armed.pop(token, None)
                if armed is None:
                    continue
                self.fired += 1
                armed.fired = True
                _shutdown(fd)


def _shutdown(fd: int) -> None:
    """Shut a connection's socket down (both ways) without closing its descriptor, which
    the driver still owns: its waiting call wakes up with an error."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


CALL_TIMER = CallTimer()
