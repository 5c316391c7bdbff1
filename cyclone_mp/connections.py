"""Connections to PostgreSQL and what their errors mean.

- **Errors:** :func:`classify` turns a driver error into the engine's
  :class:`~cyclone_mp.errors.DatabaseError` kinds (an outage, a busy row, a read-only
  primary, a rejected value), and :func:`~cyclone_mp.store.session.translate` does it for every
  :class:`~cyclone_mp.store.Store` method. :func:`redact` keeps passwords out of messages.
- **Bounds on this side:** :func:`answered_within` turns a call cut short by
  :data:`~cyclone_mp.calltimer.CALL_TIMER` into :class:`~cyclone_mp.errors.DatabaseStalled`
  for the client's waits.
- **Connections:** :func:`connect` (with TCP bounds), the PgBouncer transaction-mode
  wrappers (``Pooled*``), session settings, and the driver's names other modules use
  (:data:`DriverError`, :data:`Connection`, :data:`AsyncConnection`, :data:`dict_row`).

This module and :mod:`cyclone_mp.store` are the only ones that import the driver
(psycopg); the store keeps the SQL and the typed methods.
"""

from __future__ import annotations

import contextlib
import logging
import re
import select
from typing import Any, Iterator

import psycopg
import psycopg.sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool
from psycopg_pool import ConnectionPool

from .calltimer import CALL_TIMER
from .errors import (
    DatabaseBusy, DatabaseDiskFull, DatabaseError, DatabaseReadOnly, DatabaseStalled, DatabaseUnavailable, QueryRejected,
)

log = logging.getLogger("cyclone_mp.store")

#: The driver's names that other modules use, so that only this module and the store import it.
DriverError = psycopg.Error
Connection = psycopg.Connection
AsyncConnection = psycopg.AsyncConnection


def undefined_table(exc: BaseException | None) -> bool:
    """True when ``exc`` (or the driver error it was raised from) says a table is missing
    (the schema is not migrated)."""
    return isinstance(exc, psycopg.errors.UndefinedTable) or isinstance(
        getattr(exc, "__cause__", None), psycopg.errors.UndefinedTable)


def no_partition(exc: BaseException | None) -> bool:
    """True when ``exc`` (or its cause) says a row fits no partition of its table."""
    cause = exc if isinstance(exc, psycopg.Error) else getattr(exc, "__cause__", None)
    return isinstance(cause, psycopg.errors.CheckViolation) and "no partition" in str(cause)


def redact(text: str) -> str:
    """Return ``text`` (a DSN, or a message quoting one) with every password shown as ``***``.

    Handles URIs (``user:secret@host``, ``?password=secret``) and key=value strings,
    quoted values with spaces included and unquoted ones with escaped characters
    (``password=S3cret\\ more``); never print a secret.
    """
    text = re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", text)
    text = re.sub(r"([?&]password=)[^&\s#]*", r"\1***", text, flags=re.I)
    # An unquoted libpq value ends at white space that no backslash escapes ("S3cret\\ more");
    # an already redacted value (``password=***``, then a space, a colon and space, or the
    # end) is left alone: the CLI redacts whole messages again, and "password=***: connection
    # failed" lost its colon.
    return re.sub(r"(\bpassword\s*=\s*)(?!\*\*\*(?:[\s;,)]|:\s|:?$))('(?:[^'\\]|\\.)*'?|(?:\\.|[^\s'\\])+\\?)",
                  r"\1***", text, flags=re.I)


#: What a connection logs when it drops its prepared statements after a stale_plan error.
STALE_PLAN_LOG = ("prepared statements dropped, their plan went stale (a migration changed a column's type? or the "
                  "DSN goes through a transaction-mode pooler such as PgBouncer: then start with --pgbouncer, and "
                  "prepared statements only with PgBouncer 1.21+ and max_prepared_statements): %s")


def stale_plan(exc: BaseException | None) -> bool:
    """True for the errors of a prepared statement that a schema change invalidated:
    "cached plan must not change result type" (0A000) or a statement the server no
    longer knows (26000). The statement did not run; prepared again, it works. (A
    statement the server knows already, 42P05, is not one: a transaction-mode pooler
    without ``--pgbouncer`` causes it, and preparing again would not help; see
    :func:`pooler_hint`.)"""
    return isinstance(exc, psycopg.errors.InvalidSqlStatementName) or (
        isinstance(exc, psycopg.errors.FeatureNotSupported) and "cached plan" in str(exc))


def pooler_hint(exc: BaseException | None) -> str:
    """What to add to the message of ``exc`` when a transaction-mode pooler is its likely
    cause: a prepared statement the server knows already (42P05), which a connection sees
    when PgBouncer hands it another client's server session. Empty otherwise."""
    if isinstance(exc, psycopg.errors.DuplicatePreparedStatement):
        return (" (a prepared statement of another session: the DSN goes through a transaction-mode pooler "
                "such as PgBouncer; start with --pgbouncer)")
    return ""


#: SQLSTATEs of a session the server ended or cannot serve: an outage (reconnect, write
#: again), whatever psycopg's exception class. Class 08 (connection exception) and 57P0x
#: (admin/crash shutdown, cannot connect now) are matched by prefix.
OUTAGE_STATES = frozenset({"25P03"})  # idle_in_transaction_session_timeout: the process was frozen
OUTAGE_PREFIXES = ("08", "57P")
#: SQLSTATE classes of a call whose data the database refused; the connection is fine:
#: 54 program limit exceeded (jsonb over 256 MB, an index row too large, nesting too
#: deep), 22 data exception (bad value, out of range), 23 integrity constraint.
REJECTED_CLASSES = ("54", "22", "23")
#: A write refused because the server is a standby or the session read-only (a failover:
#: a host that was the primary came back as a replica, or the DSN reached the wrong one).
READ_ONLY_STATES = frozenset({"25006"})
BUSY_STATES = ("55P03", "57014")  # lock_not_available, query_canceled (lock_timeout, statement_timeout)
REJECTED_WHAT = {"54": "it is over a database limit", "22": "a value is invalid for its column",
                 "23": "it breaks a constraint"}
#: SQLSTATE class 53 (insufficient resources): the server cannot do this kind of work now,
#: whatever the call's data. An outage, named for what ran out.
RESOURCES_WHAT = {"53100": "the database server's disk is full", "53200": "the database server is out of memory",
                  "53300": "the database server has too many connections",
                  "53400": "a database server configuration limit was exceeded"}


def classify(exc: psycopg.Error, broken: bool = False) -> DatabaseError:
    """The :class:`DatabaseError` a psycopg error becomes, decided by its SQLSTATE (not by
    psycopg's exception class: ``OperationalError`` covers both a lost connection and a
    jsonb value over 256 MB):

    * :class:`DatabaseReadOnly` (a failover): 25006, a write refused by a
      standby or a read-only session ("cannot execute ... in a read-only transaction",
      "... during recovery"): the connection must be opened again, to the new primary;
    * :class:`DatabaseDiskFull` (an outage, named): 53100, the server's disk is full; the
      other class 53 states (out of memory, too many connections) are outages whose
      message names what ran out;
    * :class:`DatabaseUnavailable` (an outage): the connection is broken or closed
      (``broken``), a client-side error without SQLSTATE (connection lost, refused),
      class 08, 57P01-57P03, 25P03, or another ``OperationalError`` whose class is not
      below (a cancelled statement, a lock timeout: transient);
    * :class:`QueryRejected` (this one call's data): classes 54, 22 and 23;
    * :class:`DatabaseBusy` (nothing was done; try again later): a lock wait past
      ``lock_timeout`` (55P03) or a statement past ``statement_timeout`` (57014) on a
      connection that is fine;
    * :class:`DatabaseError` otherwise (a bug or a schema problem).

    The message never holds the DSN.
    """
    state = getattr(exc, "sqlstate", None) or None
    text = redact(str(exc).strip()) or type(exc).__name__
    first = text.splitlines()[0]
    if state in READ_ONLY_STATES:
        return DatabaseReadOnly(f"database read-only (a standby, or a failover under way): {first} (SQLSTATE {state})")
    if state and state.startswith("53"):
        what = RESOURCES_WHAT.get(state, "the database server is out of resources")
        return (DatabaseDiskFull if state == "53100" else DatabaseUnavailable)(f"{what} (SQLSTATE {state}): {first}")
    if state in BUSY_STATES and not broken:
        return DatabaseBusy(f"database busy: {first} (SQLSTATE {state})", lock_wait=state == "55P03")
    if state and state[:2] in REJECTED_CLASSES and not broken:
        return QueryRejected(f"the database rejected the call: {REJECTED_WHAT[state[:2]]}: {first} (SQLSTATE {state})",
                             sqlstate=state)
    if (broken or state is None and isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
            or state is not None and (state in OUTAGE_STATES or state.startswith(OUTAGE_PREFIXES))
            or isinstance(exc, psycopg.OperationalError)):
        return DatabaseUnavailable(f"database unavailable: {text if str(exc).strip() else 'connection lost'}")
    return DatabaseError(f"database error: {type(exc).__name__}: {text}{pooler_hint(exc)}")


def tcp_bounds(dead_after: float) -> dict[str, int]:
    """libpq options that make a dead or black-holed TCP peer an error within about
    ``dead_after`` seconds: keepalive probes on an idle connection
    (``keepalives_idle``/``_interval`` in whole seconds, 2 probes) and
    ``tcp_user_timeout`` for data the peer never acknowledges. Unix sockets ignore them."""
    probe = max(1, int(dead_after / 3))
    return {"keepalives": 1, "keepalives_idle": probe, "keepalives_interval": probe, "keepalives_count": 2,
            "tcp_user_timeout": max(1000, int(dead_after * 1000))}


def _stalled(seconds: float) -> DatabaseStalled:
    return DatabaseStalled(f"the database did not answer within {seconds:.3g}s (its connection stayed open"
                           " but silent: a wedged proxy or PgBouncer, a frozen server?); that connection was"
                           " closed")


@contextlib.contextmanager
def answered_within(conn: psycopg.Connection[Any], seconds: float | None) -> Iterator[None]:
    """Bound, on the client's clock, how long the calls made on ``conn`` inside the block
    wait for the server (None: no bound): past ``seconds`` :data:`CALL_TIMER` shuts the
    connection's socket, the blocked call fails and the block raises
    :class:`DatabaseStalled`. What the TCP bounds cannot see (a peer that acknowledges
    and never answers) and ``statement_timeout`` cannot either (the server that enforces
    it is the one not answering) ends here.

    Raises:
        DatabaseStalled: the server did not answer in time (the connection is broken).
    """
    if seconds is None:
        yield
        return
    with CALL_TIMER.bound(conn, max(0.0, seconds)) as armed:
        try:
            yield
        except (psycopg.Error, DatabaseError) as exc:
            if armed.fired:
                raise _stalled(seconds) from exc
            raise


@contextlib.asynccontextmanager
async def aanswered_within(conn: psycopg.AsyncConnection[Any], seconds: float | None) -> Any:
    """:func:`answered_within` for an async connection (the timer's thread shuts the
    socket; the event loop sees it at once).

    Raises:
        DatabaseStalled: the server did not answer in time (the connection is broken).
    """
    if seconds is None:
        yield
        return
    with CALL_TIMER.bound(conn, max(0.0, seconds)) as armed:
        try:
            yield
        except (psycopg.Error, DatabaseError) as exc:
            if armed.fired:
                raise _stalled(seconds) from exc
            raise


class PooledConnection(psycopg.Connection):  # type: ignore[type-arg]
    """A connection through PgBouncer in transaction mode: it keeps no session
    state. Each server connection serves other clients between two transactions, so what
    a plain connection sets once for its session (:func:`configure_session`) is set here
    inside every transaction instead (``set_config(name, value, true)``, as ``SET LOCAL``):

    * an explicit transaction (:meth:`transaction`) sets :attr:`tx_settings` first;
    * a statement outside one (autocommit) is sent in a pipeline after
      :attr:`statement_settings` (:class:`PooledCursor`): the two share the pipeline's
      implicit transaction and one round trip, and PgBouncer keeps them on one server
      connection (it hands the connection back only at the pipeline's single Sync).

    Attributes:
        tx_settings: ``(sql, params)`` run first in each explicit transaction, or None.
        statement_settings: ``(sql, params)`` run before each autocommit statement, or None.
    """

    tx_settings: tuple[str, list[str]] | None = None
    statement_settings: tuple[str, list[str]] | None = None

    @contextlib.contextmanager
    def transaction(self, savepoint_name: str | None = None, force_rollback: bool = False) -> Iterator[Any]:
        """psycopg's ``transaction()``; the outermost one starts with :attr:`tx_settings`."""
        outermost = self.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with super().transaction(savepoint_name, force_rollback) as tx:
            if outermost and self.tx_settings is not None:
                psycopg.Cursor(self).execute(*self.tx_settings, prepare=False)
            yield tx


class PooledCursor(psycopg.Cursor):  # type: ignore[type-arg]
    """The cursor of a :class:`PooledConnection` (see there)."""

    def _settings(self) -> tuple[str, list[str]] | None:
        conn = self.connection
        if (conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
                or conn.info.pipeline_status != psycopg.pq.PipelineStatus.OFF):
            return None  # inside a transaction (it set them) or a pipeline of the caller's
        return getattr(conn, "statement_settings", None)

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> "PooledCursor":
        settings = self._settings()
        if settings is None or (params is None and ";" in str(query)):  # a script: simple protocol, no pipeline
            super().execute(query, params, prepare=prepare, binary=binary)
            return self
        with statement_pipeline(self.connection):
            super().execute(query, params, prepare=prepare, binary=binary)
        return self


@contextlib.contextmanager
def statement_pipeline(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A pipeline of autocommit statements on ``conn``: one Sync, one round trip, one
    implicit transaction. Through PgBouncer (a :class:`PooledConnection`) its
    ``statement_settings`` go first, so they cover every statement of it; a plain
    connection set them for its session."""
    with conn.pipeline():
        settings = getattr(conn, "statement_settings", None)
        if settings is not None:
            psycopg.Cursor(conn).execute(*settings, prepare=False)
        yield


class PooledAsyncConnection(psycopg.AsyncConnection):  # type: ignore[type-arg]
    """:class:`PooledConnection` for the :class:`~cyclone_mp.AsyncClient`: its explicit
    transactions start with :attr:`tx_settings` (its autocommit statements need none)."""

    tx_settings: tuple[str, list[str]] | None = None

    @contextlib.asynccontextmanager
    async def transaction(self, savepoint_name: str | None = None, force_rollback: bool = False) -> Any:
        """psycopg's ``transaction()``; the outermost one starts with :attr:`tx_settings`."""
        outermost = self.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        async with super().transaction(savepoint_name, force_rollback) as tx:
            if outermost and self.tx_settings is not None:
                await psycopg.AsyncCursor(self).execute(*self.tx_settings, prepare=False)
            yield tx


def connect(dsn: str, *, autocommit: bool = True, timeout: float = 10.0, dead_after: float = 30.0,
            application_name: str | None = None, pgbouncer: bool = False, prepare: bool = True) -> psycopg.Connection:
    """Open one connection with dict rows; ``timeout``: seconds to connect;
    ``dead_after``: seconds after which a silent TCP peer is an error (:func:`tcp_bounds`);
    ``application_name``: what ``pg_stat_activity`` shows for it (at most 63 bytes kept).
    ``pgbouncer``: the DSN goes through PgBouncer in transaction mode: a
    :class:`PooledConnection`, whose settings are per transaction. ``prepare``: False
    turns psycopg's named prepared statements off (``prepare_threshold=None``): PgBouncer
    in transaction mode without ``max_prepared_statements`` cannot keep them.

    Raises:
        DatabaseReadOnly: the server reached is a standby (``in_hot_standby``), and
            ``target_session_attrs=read-write`` was not in the DSN to skip it.
        DatabaseUnavailable: the server cannot be reached (message without the password).
    """
    extra: dict[str, Any] = {}
    if application_name:
        extra["application_name"] = application_name[:63]
    if pgbouncer:
        extra["cursor_factory"] = PooledCursor
    cls = PooledConnection if pgbouncer else psycopg.Connection
    try:
        conn = cls.connect(dsn, autocommit=autocommit, row_factory=dict_row, connect_timeout=max(2, int(timeout)),
                           **tcp_bounds(dead_after), **extra)
    except psycopg.Error as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {redact(dsn)}: {redact(detail)}") from exc
    if not prepare:
        conn.prepare_threshold = None
    if conn.info.parameter_status("in_hot_standby") == "on":  # reported by PostgreSQL 14 and later
        conn.close()
        raise DatabaseReadOnly("connected to a standby (in recovery): a failover under way, or the DSN "
                               "lacks target_session_attrs=read-write")
    return conn


def server_spoke(conn: Any) -> bool:
    """True when something arrived on an idle connection's socket since its last call (an
    idle client connection receives nothing unless the server ends it: a restart sends
    FATAL and closes; a hung-up socket reads as EOF), or it is closed already. Asks the
    kernel (``poll`` with no wait), not the server: no round trip.

    The API pools' ``check``: a pooled connection is checked with a round trip
    (psycopg_pool's ``check_connection``) only when this says the server spoke; a warm
    connection costs its call nothing more. A server gone without a word (a host
    powered off) is found by the call itself, within the connection's TCP bounds."""
    if conn.closed or conn.broken:
        return True
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def check_pooled(conn: psycopg.Connection) -> None:
    """A client pool's ``check``: raises when a pooled connection is no longer usable,
    with a round trip only if :func:`server_spoke` (else none)."""
    if server_spoke(conn):
        ConnectionPool.check_connection(conn)


async def acheck_pooled(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`check_pooled` for the async client's pool."""
    if server_spoke(conn):
        await AsyncConnectionPool.check_connection(conn)


def session_settings(*, generic_plans: bool = False, idle_in_transaction: float | None = None,
                     lock_timeout: float | None = None, statement_timeout: float | None = None) -> dict[str, str]:
    """The server settings of a cyclone_mp connection, by name (see :func:`configure_session`)."""
    settings = {}
    if lock_timeout is not None:
        settings["lock_timeout"] = f"{max(1, int(lock_timeout * 1000))}ms"
    if statement_timeout is not None:
        settings["statement_timeout"] = f"{max(1, int(statement_timeout * 1000))}ms"
    if generic_plans:
        settings["plan_cache_mode"] = "force_generic_plan"
        # A generic plan is made once, at the first call: on a steps table still small
        # then (a fresh database; a map's items, inserted after the supervisor started)
        # it chose sequential scans and kept them as the table grew (20,000 steps
        # enqueued after the start ran at 1,835/s, 10,910/s when enqueued before). Every
        # statement of these connections reads by index: the planner is held to it.
        settings["enable_seqscan"] = "off"
    if idle_in_transaction is not None:
        settings["idle_in_transaction_session_timeout"] = f"{max(1, int(idle_in_transaction * 1000))}ms"
    return settings


def configure_session(conn: psycopg.Connection, *, generic_plans: bool = False,
                      idle_in_transaction: float | None = None, lock_timeout: float | None = None,
                      statement_timeout: float | None = None) -> None:
    """Session settings of a cyclone_mp connection, in one round trip (``SET``, so a proxy
    that refuses startup options still works); on a :class:`PooledConnection` (PgBouncer
    in transaction mode), no round trip: they are kept on it and set in each transaction.

    ``generic_plans``: ``plan_cache_mode = force_generic_plan`` and ``enable_seqscan =
    off`` (see :meth:`Store.open`).
    ``idle_in_transaction`` (seconds): ``idle_in_transaction_session_timeout``, so a
    process frozen inside one of its transactions does not hold row locks that other
    supervisors wait on (the server ends that session; the process reconnects and
    writes again). ``lock_timeout`` and ``statement_timeout`` (seconds) bound what a call
    may wait for on the server (the supervisor's connections). Raises psycopg.Error.
    """
    settings = session_settings(generic_plans=generic_plans, idle_in_transaction=idle_in_transaction,
                                lock_timeout=lock_timeout, statement_timeout=statement_timeout)
    if isinstance(conn, (PooledConnection, PooledAsyncConnection)):
        conn.tx_settings = _set_config(settings, local=True) if settings else None
        if isinstance(conn, PooledConnection):
            # idle_in_transaction_session_timeout means nothing outside a transaction
            per_statement = {k: v for k, v in settings.items() if k != "idle_in_transaction_session_timeout"}
            conn.statement_settings = _set_config(per_statement, local=True) if per_statement else None
        return
    if settings:
        conn.execute(*_set_config(settings))


def _set_config(settings: dict[str, str], local: bool = False) -> tuple[str, list[str]]:
    call = "set_config(%s, %s, true)" if local else "set_config(%s, %s, false)"
    return ("SELECT " + ", ".join(call for _ in settings), [v for kv in settings.items() for v in kv])


async def aconfigure_session(conn: psycopg.AsyncConnection[Any], *, idle_in_transaction: float) -> None:
    """:func:`configure_session` of an async client's connection (its
    ``idle_in_transaction``, in seconds). Raises psycopg.Error."""
    settings = session_settings(idle_in_transaction=idle_in_transaction)
    if isinstance(conn, PooledAsyncConnection):
        conn.tx_settings = _set_config(settings, local=True)
        return
    await conn.execute(*_set_config(settings))


def database_dsn(dsn: str, name: str) -> str:
    """``dsn`` pointed at database ``name`` (every other parameter kept)."""
    return psycopg.conninfo.make_conninfo(dsn, dbname=name)
