"""The store's session: one connection, its transactions, and the client's operations on
it (:class:`Session`, which every query object of :class:`~cyclone_mp.store.Store` runs
on), and :class:`AsyncStore` (the async client's).

psycopg errors become :class:`~cyclone_mp.errors.DatabaseError` with the cause kept
(STYLE pattern 2; :func:`translate`); :func:`drive` runs an operation planned in
:mod:`cyclone_mp.store.operations`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Self

import psycopg
from psycopg.rows import dict_row

from ..connections import STALE_PLAN_LOG, classify, configure_session, connect, redact, stale_plan
from ..errors import DatabaseError, DatabaseUnavailable, QueryRejected
from . import operations
from .queries import Q

log = logging.getLogger("cyclone_mp.store")


class Session:
    """One autocommit connection: its transactions, the translation of its errors, and the
    client's operations (:mod:`cyclone_mp.store.operations`) run on it. The query objects
    of :class:`~cyclone_mp.store.Store` (``store.claims``, ``store.outcomes``, ...) each
    run their statements through one.

    Attributes:
        conn: the psycopg connection (autocommit, dict rows).
        commits: transactions this session committed.
        failed_before_commit: whether the last transaction failed in its body (nothing of
            it committed): the client retries a call that surely did nothing.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.commits = 0
        self.failed_before_commit = False

    @classmethod
    def open(cls, dsn: str, *, generic_plans: bool = False, idle_in_transaction: float | None = None,
             lock_timeout: float | None = None, statement_timeout: float | None = None,
             dead_after: float = 30.0, connect_timeout: float = 10.0, application_name: str | None = None,
             pgbouncer: bool = False, prepare: bool = True) -> Self:
        """Connect to ``dsn``; raises DatabaseError.

        ``generic_plans`` makes PostgreSQL reuse one plan per prepared statement
        (``plan_cache_mode = force_generic_plan``) instead of re-planning the many-CTE
        hot-path statements with each call's values: planning them cost more than running
        them (about half of a claim-and-complete). Only for
        the supervisor's connection, whose statements all read by index whatever the values
        (``enable_seqscan = off`` holds the plans to it, whatever the table's size when
        they were made).
        ``idle_in_transaction``, ``lock_timeout``, ``statement_timeout`` (seconds): see
        :func:`configure_session`; ``dead_after``, ``connect_timeout``, ``application_name``,
        ``pgbouncer``, ``prepare``: see :func:`connect` (without prepared statements,
        ``generic_plans`` has nothing to act on).
        """
        conn = connect(dsn, timeout=connect_timeout, dead_after=dead_after, application_name=application_name,
                       pgbouncer=pgbouncer, prepare=prepare)
        generic_plans = generic_plans and prepare
        if generic_plans:
            # Prepared (and planned) at the first call, not the fifth: the first calls
            # of a start planned each many-CTE statement again, about 2 ms each.
            conn.prepare_threshold = 0
        try:
            configure_session(conn, generic_plans=generic_plans, idle_in_transaction=idle_in_transaction,
                              lock_timeout=lock_timeout, statement_timeout=statement_timeout)
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(f"cannot configure the connection: {redact(str(exc))}") from exc
        return cls(conn)

    def forget_prepared(self, error: DatabaseError) -> None:
        """After ``error`` (a :func:`stale_plan` one): drop this connection's prepared
        statements (``DEALLOCATE ALL``, which psycopg sees and clears its own cache for);
        a no-op inside a transaction, whose ROLLBACK does the same."""
        log.warning(STALE_PLAN_LOG, error)
        with contextlib.suppress(psycopg.Error):
            if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self.conn.execute("DEALLOCATE ALL", prepare=False)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with contextlib.suppress(Exception):
            self.conn.close()

    @property
    def broken(self) -> bool:
        """True when the connection is closed or lost."""
        return self.conn.closed or self.conn.broken

    @contextlib.contextmanager
    def tx(self) -> Iterator[psycopg.Cursor]:
        """One transaction. Records whether it failed in its body (before COMMIT: then
        nothing of it was committed, even if the connection died) and counts commits, so
        a caller knows when running it again is safe (:meth:`Client._call`)."""
        self.failed_before_commit = False
        with self.conn.transaction(), self.conn.cursor() as cur:
            try:
                yield cur
            except BaseException:
                self.failed_before_commit = True
                raise
        self.commits += 1

    @staticmethod
    def one(cur: psycopg.Cursor, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """Run the named statement ``name`` on ``cur``; its first row, or None."""
        cur.execute(Q[name], params)
        return cur.fetchone() if cur.description else None

    # -- the client's operations (cyclone_mp.operations, shared with AsyncStore) ------------

    def run(self, op: operations.Op, *, caller_tx: bool = False) -> Any:
        """Run a planned operation (:mod:`cyclone_mp.operations`) on this store's
        connection: in a transaction of its own when the operation needs one, unless
        ``caller_tx`` (the connection is the caller's, inside the caller's open
        transaction: the operation's rows exist only if it commits).

        Raises:
            DatabaseError: see :func:`translate`; what the operation itself raises
                (RunNotFound, InvalidTransition, ...).
        """
        try:
            if caller_tx or not op.transaction:
                with self.conn.cursor(row_factory=dict_row) as cur:
                    return drive(cur, op)
            with self.tx() as cur:
                return drive(cur, op)
        except psycopg.Error as exc:
            raise self._translated(exc) from exc
        except UnicodeEncodeError as exc:  # a value psycopg cannot send (a lone surrogate)
            raise QueryRejected(f"value rejected: {exc}") from exc

    def _translated(self, exc: psycopg.Error) -> DatabaseError:
        error = classify(exc, broken=self.broken)
        if not isinstance(error, DatabaseUnavailable) and stale_plan(exc):
            self.forget_prepared(error)
        return error

    def migrate(self) -> list[str]:
        """Apply pending numbered migrations under an advisory lock; returns their names.

        Idempotent and safe to run from many processes at once.
        """
        return self.run(operations.migrate())


def drive(cur: psycopg.Cursor, op: Any) -> Any:
    """Run the steps of ``op`` (a :class:`cyclone_mp.store.operations.Op`, or its generator) on
    a sync cursor: each yielded statement is executed and its result sent back; returns
    what the operation returns."""
    steps = iter(op)
    try:
        statement = next(steps)
        while True:
            cur.execute(statement.sql, statement.params, prepare=statement.prepare)
            result = operations.Result(cur.fetchall() if cur.description else [], cur.rowcount)
            statement = steps.send(result)
    except StopIteration as stop:
        return stop.value


async def adrive(cur: psycopg.AsyncCursor[Any], op: Any) -> Any:
    """:func:`drive` on an async cursor."""
    steps = iter(op)
    try:
        statement = next(steps)
        while True:
            await cur.execute(statement.sql, statement.params, prepare=statement.prepare)
            result = operations.Result(await cur.fetchall() if cur.description else [], cur.rowcount)
            statement = steps.send(result)
    except StopIteration as stop:
        return stop.value


class AsyncStore:
    """The client's operations (:mod:`cyclone_mp.operations`) over one async psycopg
    connection: :class:`Store`'s sync driver, awaited. Errors are translated the same way.

    Attributes:
        commits, failed_before_commit: as :class:`Store`'s (the client retries a call
            that surely did nothing).
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.commits = 0
        self.failed_before_commit = False

    @property
    def broken(self) -> bool:
        """True when the connection is closed or lost."""
        return self.conn.closed or self.conn.broken

    async def run(self, op: Any, *, caller_tx: bool = False) -> Any:
        """:meth:`Session.run`, awaited."""
        try:
            if caller_tx or not op.transaction:
                async with self.conn.cursor(row_factory=dict_row) as cur:
                    return await adrive(cur, op)
            self.failed_before_commit = False
            async with self.conn.transaction():
                async with self.conn.cursor(row_factory=dict_row) as cur:
                    try:
                        value = await adrive(cur, op)
                    except BaseException:
                        self.failed_before_commit = True
                        raise
            self.commits += 1
            return value
        except psycopg.Error as exc:
            error = classify(exc, broken=self.broken)
            if not isinstance(error, DatabaseUnavailable) and stale_plan(exc):
                log.warning(STALE_PLAN_LOG, error)
                with contextlib.suppress(psycopg.Error):
                    if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                        await self.conn.execute("DEALLOCATE ALL", prepare=False)
            raise error from exc
        except UnicodeEncodeError as exc:
            raise QueryRejected(f"value rejected: {exc}") from exc


def translate(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: psycopg errors leave as a :class:`DatabaseError` chosen by
    :func:`classify` (cause kept, no DSN in the text). After a :func:`stale_plan` error
    the connection's prepared statements are dropped, so the next call prepares them
    again (else a migration that changed a column type would fail every later call on
    that connection)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except psycopg.Error as exc:
            owner = args[0] if args else None  # a Session, or a query object on one (its ``session`` or ``store``)
            store = owner if isinstance(owner, Session) else getattr(owner, "session", getattr(owner, "store", None))
            store = store if isinstance(store, Session) else None
            error = classify(exc, broken=store is not None and store.broken)
            if store is not None and not isinstance(error, DatabaseUnavailable) and stale_plan(exc):
                store.forget_prepared(error)
            raise error from exc
        except UnicodeEncodeError as exc:  # a value psycopg cannot send (a lone surrogate)
            raise QueryRejected(f"value rejected: {exc}") from exc

    return wrapper

