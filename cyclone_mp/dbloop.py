"""A supervisor part that owns one database connection, on a thread of its own (issue 17).

The lease keeper, the outcome writer and maintenance each run on a
:class:`DatabaseThread`: they wait on their :class:`~cyclone_mp.mailbox.Inbox`, talk to
PostgreSQL over their own connection, reconnect with backoff after an outage, and never
block process control, which runs on another thread and never calls the database.

Every call is bounded (SPEC 9, "every database call has a client-side bound"):

- on the server, by the session's ``lock_timeout`` and ``statement_timeout``;
- on the wire, by TCP keepalives and ``tcp_user_timeout`` (:func:`cyclone_mp.connections.tcp_bounds`);
- on this side, by :class:`CallTimer`: a call still waiting after its bound has its socket
  shut down, so the waiting thread gets an error at once (a black-holed connection
  answers nothing, and keepalives work in whole seconds); the connection is then
  abandoned and opened again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

from .errors import DatabaseError, DatabaseUnavailable
from .mailbox import Inbox
from .store import Store

log = logging.getLogger("cyclone_mp.supervisor")

RECONNECT_FIRST = 0.1  # seconds before the first try to reconnect; it doubles up to the part's cap


class CallTimer:
    """Shuts down the socket of a call that outlives its bound (one thread per process).

    ``with timer.bound(store, seconds): store.method(...)`` arms a timer for the call;
    leaving the block disarms it. A shut-down socket makes psycopg raise at once, which
    the store reports as :class:`~cyclone_mp.errors.DatabaseUnavailable`.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, int]] = []
        self._armed: dict[int, int] = {}  # token -> socket fd
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired = 0  # calls cut short (for tests and stats)

    @contextlib.contextmanager
    def bound(self, store: Store, seconds: float) -> Iterator[None]:
        """Bound the calls made on ``store`` inside the block to ``seconds``."""
        try:
            fd = store.conn.pgconn.socket
        except Exception:  # noqa: BLE001 - a closed connection: the call fails on its own
            yield
            return
        token = next(self._tokens)
        due = time.monotonic() + seconds
        with self._lock:
            self._armed[token] = fd
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
            yield
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
                if self._armed.pop(token, None) is None:
                    continue
                self.fired += 1
                _shutdown(fd)


def _shutdown(fd: int) -> None:
    """Shut a connection's socket down (both ways) without closing its descriptor, which
    psycopg still owns: its waiting call wakes up with an error."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


CALL_TIMER = CallTimer()


class DatabaseThread:
    """A part of the supervisor with a thread, an inbox and one connection of its own.

    Subclasses implement :meth:`turn` (one pass of work; returns when to run again, local
    monotonic seconds) and may override :meth:`connected` / :meth:`disconnected`.

    Args:
        part: the part's name ("lease keeper", ...): its thread is ``cyclone-<part>`` and
            its connection's ``application_name`` is ``cyclone_mp <part> <owner>``.
        dsn: PostgreSQL connection string.
        config: the supervisor's :class:`~cyclone_mp.config.Config` (the session's limits
            and the reconnect backoff's cap come from it).
        owner: the supervisor's id.
        bound: seconds a call may take (``statement_timeout``, a silent peer, and
            :class:`CallTimer`'s default for :meth:`call`).
        generic_plans: see :meth:`cyclone_mp.store.Store.open`.
        clock: local monotonic clock in seconds.
    """

    def __init__(self, part: str, dsn: str, config: Any, *, owner: str, bound: float, generic_plans: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = "cyclone-" + part.replace(" ", "-")
        self.inbox = Inbox()
        self.clock = clock
        self.bound = bound

        def open_store() -> Store:
            return Store.open(dsn, generic_plans=generic_plans, idle_in_transaction=config.idle_in_transaction_limit,
                              lock_timeout=config.lock_timeout, statement_timeout=bound, dead_after=bound,
                              connect_timeout=max(2.0, bound), application_name=f"cyclone_mp {part} {owner}",
                              pgbouncer=config.pgbouncer, prepare=config.prepared_statements)

        self._open_store = open_store
        self.store: Store | None = None
        self.db_ok = False
        self._reconnect_at = clock()
        self._reconnect_cap = config.reconnect_cap
        self._reconnect_delay = RECONNECT_FIRST
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats: dict[str, int] = {}
        self.call_started: float | None = None  # when the call in progress began (local monotonic), or None

    # -- life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (returns at once; the first connection is made there)."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to end (after :meth:`finish`); returns at once."""
        self._stopping.set()
        self.inbox.wake()

    def join(self, timeout: float, *, hung_after: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; True if it did. With
        ``hung_after``, stop waiting earlier once a call has been in progress that long
        (a partition: it would only end at its bound). A thread stuck in a call is left
        behind (a daemon: it dies with the process)."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + max(0.0, timeout)
        while self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            started = self.call_started
            if hung_after is not None and started is not None and self.clock() - started > hung_after:
                break
            self._thread.join(min(left, 0.02))
        return not self._thread.is_alive()

    def stop(self, timeout: float) -> bool:
        """:meth:`request_stop`, then :meth:`join`."""
        self.request_stop()
        return self.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                now = self.clock()
                if not self.db_ok and now >= self._reconnect_at:
                    self._connect()
                try:
                    wake_at = self.turn(self.clock())
                except Exception:  # noqa: BLE001 - nothing may end a part of the supervisor
                    log.exception("%s: unexpected error; carrying on", self.name)
                    wake_at = self.clock() + 0.1
                if not self.db_ok:
                    wake_at = min(wake_at, self._reconnect_at)
                self.wait(max(0.0, wake_at - self.clock()))
            self.finish()
        finally:
            self._close()

    def wait(self, timeout: float) -> None:
        """Wait for a message or ``timeout`` seconds (subclasses may watch more)."""
        self.inbox.wait(timeout)

    def turn(self, now: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:
        """Called on the thread once it is asked to stop (last writes); default nothing."""

    # -- the connection ----------------------------------------------------------------------

    def _connect(self) -> None:
        self._close()
        self.call_started = self.clock()  # a connect may hang as a call does (a black hole)
        try:
            self.store = self._open_store()
        except DatabaseError as exc:
            self._schedule_reconnect()
            log.info("%s: cannot connect (next try in %.1fs): %s", self.name, self._reconnect_delay, exc)
            return
        finally:
            self.call_started = None
        self.db_ok = True  # the backoff starts again from RECONNECT_FIRST once a call succeeds
        try:
            self.connected()
        except DatabaseError as exc:
            self.down(exc)

    def connected(self) -> None:
        """The connection is (re)opened: set up what needs it (LISTEN, say)."""

    def disconnected(self) -> None:
        """The connection was lost (it is closed already)."""

    def down(self, exc: Exception) -> bool:
        """React to a failed call; True when it was an outage (the connection is dropped and
        reopened after a backoff). Any other error leaves the connection alone and the
        caller handles that one call.

        A read-only error (:class:`~cyclone_mp.errors.DatabaseReadOnly`: a failover) is an
        outage too: the next connection goes to the new primary when the DSN names every
        host with ``target_session_attrs=read-write``. The backoff doubles up to the cap
        until a call succeeds, not merely a connect, so a connection that opens and then
        fails at once (a host still in recovery) never makes a tight loop (issue 22)."""
        if not isinstance(exc, DatabaseUnavailable) and self.store is not None and not self.store.broken:
            return False
        if self.db_ok:
            log.warning("%s: database lost (%s); reconnecting", self.name, exc)
        self.db_ok = False
        self._close()
        self._schedule_reconnect()
        self.disconnected()
        return True

    def _schedule_reconnect(self) -> None:
        self._reconnect_at = self.clock() + self._reconnect_delay
        self._reconnect_delay = min(self._reconnect_cap, self._reconnect_delay * 2)

    def _close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def call(self, seconds: float, fn: Callable[[Store], Any]) -> Any:
        """Run ``fn(store)`` bounded to ``seconds`` (:class:`CallTimer`).

        Raises:
            DatabaseUnavailable: no connection, or it was lost (the part reconnects).
            DatabaseError: the call was rejected (the connection is fine).
        """
        store = self.store
        if store is None or not self.db_ok:
            raise DatabaseUnavailable("not connected")
        self.call_started = self.clock()
        try:
            with CALL_TIMER.bound(store, seconds):
                value = fn(store)
            self._reconnect_delay = RECONNECT_FIRST
            return value
        except DatabaseError as exc:
            self.down(exc)
            raise
        finally:
            self.call_started = None

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to one of this part's counters (read by ``Supervisor.stats``)."""
        self.stats[key] = self.stats.get(key, 0) + n
