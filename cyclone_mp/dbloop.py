"""A supervisor part that owns one database connection, on a thread of its own.

The lease keeper, the outcome writer and maintenance each run on a
:class:`DatabaseThread`: they wait on their :class:`~cyclone_mp.mailbox.Inbox`, talk to
PostgreSQL over their own connection, reconnect with backoff after an outage, and never
block process control, which runs on another thread and never calls the database.

Every call is bounded (SPEC 9, "every database call has a client-side bound"):

- on the server, by the session's ``lock_timeout`` and ``statement_timeout``;
- on the wire, by TCP keepalives and ``tcp_user_timeout`` (:func:`cyclone_mp.connections.tcp_bounds`);
- on this side, by :class:`~cyclone_mp.connections.CallTimer`: a call still waiting
  after its bound has its socket shut down, so the waiting thread gets an error at once
  (a black-holed connection answers nothing, and keepalives work in whole seconds); the
  connection is then abandoned and opened again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .calltimer import CALL_TIMER
from .errors import DatabaseError, DatabaseUnavailable
from .mailbox import Inbox
from .store import Store

log = logging.getLogger("cyclone_mp.supervisor")

RECONNECT_FIRST = 0.1  # seconds before the first try to reconnect; it doubles up to the part's cap




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
            :class:`~cyclone_mp.connections.CallTimer`'s default for :meth:`call`).
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
                if not self.db_ok and now >= self._reconnect_at and self.wants_connection():
                    self._connect()
                try:
                    wake_at = self.turn(self.clock())
                except Exception:  # noqa: BLE001 - nothing may end a part of the supervisor
                    log.exception("%s: unexpected error; carrying on", self.name)
                    wake_at = self.clock() + 0.1
                if not self.db_ok:
                    # Disconnected: what a turn has due (a renewal, a retried write, a sweep)
                    # needs the database, so a due time already past waits for the next
                    # connect rather than turning the loop without pause through the outage
                    # (a message still wakes the thread at once).
                    if self.wants_connection():
                        wake_at = self._reconnect_at
                    else:
                        wake_at = max(wake_at, self.clock() + RECONNECT_FIRST)
                self.wait(max(0.0, wake_at - self.clock()))
            self.finish()
        finally:
            self._close()
            self.inbox.close()  # its pipe: a supervisor started and stopped in a long-lived process leaks none

    def wait(self, timeout: float) -> None:
        """Wait for a message or ``timeout`` seconds (subclasses may watch more)."""
        self.inbox.wait(timeout)

    def wants_connection(self) -> bool:
        """Whether to (re)connect now; default always. A part with occasional work may
        connect only when it has some (and close its connection when idle)."""
        return True

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
        fails at once (a host still in recovery) never makes a tight loop."""
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
        """Run ``fn(store)`` bounded to ``seconds`` (:class:`~cyclone_mp.connections.CallTimer`).

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
