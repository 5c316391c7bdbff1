"""How a client's call reaches the database: a pooled connection (:mod:`.pools`, made at
the first call after one connection proved the server reachable), a bound on the call on
the client's clock, and one retry on another connection when the call surely did
nothing. :class:`PooledCalls` serves :class:`~cyclone_mp.Client`,
:class:`AsyncPooledCalls` serves :class:`~cyclone_mp.AsyncClient`; both ask their owner
(a :class:`~cyclone_mp.planning.ClientBase`) what an error means to the user.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import psycopg

from ..connections import aanswered_within, answered_within, classify, connect
from ..errors import (
    DatabaseError,
    DatabaseReadOnly,
    DatabaseStalled,
    DatabaseUnavailable,
)
from .session import AsyncStore, Session
from .pools import (
    POOL_TIMEOUT,
    AsyncConnectionPool,
    ConnectionPool,
    PoolTimeout,
    api_pool,
    aprobe,
    async_api_pool,
)

#: Seconds between two looks, while a call waits for a pooled connection, at whether the
#: embedded server is stopping: a server that went away fails the call at once, not
#: after POOL_TIMEOUT.
POOL_PROBE_EVERY = 1.0


def _still_waiting(owner: Any, server: Any, deadline: float, within: float | None) -> Any:
    """After a wait for a pooled connection timed out: the embedded server the DSN names,
    looked up the first time (``server`` False until then), returned for the next look.

    Raises:
        DatabaseUnavailable: that server is stopping (one line that says so).
        DatabaseStalled: the call's bound ``within`` (seconds) passed at ``deadline``.
    """
    if server is False:
        server = owner._embedded()
    if server is not None and server.stopping():
        raise DatabaseUnavailable(server.not_running_message()) from None
    if time.monotonic() >= deadline and within is not None:
        raise DatabaseStalled(f"no connection to the database within {within:.3g}s") from None
    return server


@contextlib.contextmanager
def _call_errors(owner: Any) -> Iterator[None]:
    """What a failed call raises: a driver error from the pool (a timeout waiting for a
    connection: an outage) as its :class:`DatabaseError`; a DatabaseError as ``owner``
    says it to the user (``_call_failed``: a missing schema, a stopped embedded server)."""
    try:
        yield
    except psycopg.Error as exc:
        raise classify(exc) from exc
    except DatabaseError as exc:
        failed = owner._call_failed(exc)
        if failed is not exc:
            raise failed from exc
        raise


class PooledCalls:
    """The sync calls of ``owner`` (a :class:`~cyclone_mp.planning.ClientBase`: its ``dsn``,
    ``config``, ``_embedded()``, ``_explain()``, ``_retryable()`` and ``_call_failed()``),
    on a pool made at the first call."""

    def __init__(self, owner: Any, store_class: type[Session]) -> None:
        self.owner = owner
        self.store_class = store_class
        self.pool_: ConnectionPool | None = None
        self._lock = threading.Lock()

    def pool(self, within: float | None = None) -> ConnectionPool:
        """The pool, made at the first call: a connection is opened first (within
        ``within`` seconds, the first call's bound, else 10), so an unreachable server
        fails that call at once with a clear message. Raises DatabaseUnavailable."""
        with self._lock:
            if self.pool_ is None:
                dsn, config = self.owner.dsn, self.owner.config
                try:
                    connect(dsn, timeout=10.0 if within is None else min(10.0, within)).close()
                except DatabaseUnavailable as exc:
                    raise self.owner._explain(exc) from exc.__cause__
                self.pool_ = api_pool(dsn, pgbouncer=config.pgbouncer, prepared_statements=config.prepared_statements,
                                      idle_in_transaction=config.idle_in_transaction_limit, lease_ttl=config.lease_ttl)
            return self.pool_

    @contextlib.contextmanager
    def connection(self, pool: ConnectionPool, within: float | None = None) -> Iterator[Any]:
        """A pooled connection, like ``pool.connection()``. While a call waits for one, an
        embedded server that was stopped fails it within POOL_PROBE_EVERY seconds, with
        one line that says so. Any other server may come back (a restart): the call waits
        up to POOL_TIMEOUT, then fails with why a fresh connection fails; or, given
        ``within`` (the call's bound, seconds), raises DatabaseStalled after that long."""
        deadline = time.monotonic() + (POOL_TIMEOUT if within is None else within)
        server: Any = False  # looked up once a wait is long (it reads files: not on every call)
        while True:
            try:
                conn = pool.getconn(timeout=max(0.05, min(POOL_PROBE_EVERY, deadline - time.monotonic())))
                break
            except PoolTimeout:
                server = _still_waiting(self.owner, server, deadline, within)
                if time.monotonic() >= deadline:
                    try:
                        connect(self.owner.dsn, timeout=5.0).close()
                    except DatabaseUnavailable as exc:  # why a fresh connection fails
                        raise exc from None
                    raise
        try:
            with conn:
                yield conn
        finally:
            pool.putconn(conn)

    def call(self, fn: Callable[[Any], Any], within: float | None = None) -> Any:
        """``fn(store)`` on a pooled connection (once more on another when it surely did
        nothing). ``within``: seconds the call may take, the wait for a connection
        included, on this process's clock (None: the connections' own bounds); past it the
        connection is closed, the pool's other connections are replaced (they came the
        same way), and DatabaseStalled is raised. Raises DatabaseError."""
        deadline = None if within is None else time.monotonic() + within
        pool = self.pool(within)
        with _call_errors(self.owner):
            for tries_left in (1, 0):
                store: Any = None
                try:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    with self.connection(pool, left) as conn:
                        store = self.store_class(conn)
                        try:
                            with answered_within(conn, None if deadline is None else deadline - time.monotonic()):
                                return fn(store)
                        except DatabaseReadOnly:  # a failover: no pooled connection is worth keeping
                            conn.close()  # the pool discards it when it comes back
                            pool.drain()
                            raise
                        except DatabaseStalled:
                            pool.drain()
                            raise
                except DatabaseError as exc:
                    if isinstance(exc, DatabaseStalled) or not self.owner._retryable(exc, store, tries_left):
                        raise

    def close(self) -> None:
        """Close the pool (a later call makes a new one)."""
        with self._lock:
            pool, self.pool_ = self.pool_, None
        if pool is not None:
            pool.close()


class AsyncPooledCalls:
    """:class:`PooledCalls` for an async owner: ``await calls.run(op)``."""

    def __init__(self, owner: Any, size: int) -> None:
        self.owner = owner
        self.size = size
        self.pool_: AsyncConnectionPool | None = None
        self._lock: asyncio.Lock | None = None

    async def pool(self, within: float | None = None) -> AsyncConnectionPool:
        """The pool, made at the first call (as :meth:`PooledCalls.pool`)."""
        if self.pool_ is not None:  # the common case: no lock to take
            return self.pool_
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.pool_ is None:
                owner = self.owner
                dsn = owner._dsn if owner._dsn is not None else await asyncio.to_thread(lambda: owner.dsn)
                try:  # fail fast, with a clear message, when unreachable
                    await aprobe(dsn, 10.0 if within is None else min(10.0, within))
                except DatabaseUnavailable as exc:
                    raise owner._explain(exc) from exc.__cause__
                config = owner.config
                self.pool_ = await async_api_pool(
                    dsn, pgbouncer=config.pgbouncer, prepared_statements=config.prepared_statements,
                    idle_in_transaction=config.idle_in_transaction_limit, lease_ttl=config.lease_ttl,
                    max_size=self.size)
            return self.pool_

    async def connection(self, pool: AsyncConnectionPool, within: float | None = None) -> Any:
        """A pooled connection (as :meth:`PooledCalls.connection`); the caller puts it back."""
        deadline = time.monotonic() + (POOL_TIMEOUT if within is None else within)
        server: Any = False
        while True:
            try:
                return await pool.getconn(timeout=max(0.05, min(POOL_PROBE_EVERY, deadline - time.monotonic())))
            except PoolTimeout:
                server = _still_waiting(self.owner, server, deadline, within)
                if time.monotonic() >= deadline:
                    raise

    async def run(self, op: Callable[[], Any], within: float | None = None) -> Any:
        """Run the operation ``op()`` makes (:mod:`cyclone_mp.store.operations`) on a pooled
        connection; once more on another when the call surely did nothing; ``within``:
        seconds the call may take (as :meth:`PooledCalls.call`). Raises DatabaseError."""
        deadline = None if within is None else time.monotonic() + within
        pool = await self.pool(within)
        with _call_errors(self.owner):
            for tries_left in (1, 0):
                store: AsyncStore | None = None
                try:
                    conn = await self.connection(pool, None if deadline is None else max(0.0, deadline - time.monotonic()))
                    try:
                        store = AsyncStore(conn)
                        async with aanswered_within(conn, None if deadline is None else deadline - time.monotonic()):
                            return await store.run(op())
                    except DatabaseReadOnly:  # a failover: no pooled connection is worth keeping
                        await conn.close()
                        await pool.drain()
                        raise
                    except DatabaseStalled:  # the pool's other connections came the same way
                        await pool.drain()
                        raise
                    finally:
                        await pool.putconn(conn)
                except DatabaseError as exc:
                    if isinstance(exc, DatabaseStalled) or not self.owner._retryable(exc, store, tries_left):
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        """Close the pool (a later call makes a new one)."""
        pool, self.pool_ = self.pool_, None
        if pool is not None:
            await pool.close()
