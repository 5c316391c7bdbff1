"""The clients' connection pools (psycopg_pool), sync and async, set up one way: autocommit
dict rows, TCP bounds so a dead server is an error within about ``lease_ttl``, the
session's ``idle_in_transaction_session_timeout`` (a client frozen mid-call never stalls
the supervisors), PgBouncer's transaction-mode wrappers when asked, and a check of each
connection handed out (a restarted server leaves dead ones).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout  # noqa: F401 - PoolTimeout for callers

from ..connections import (
    PooledAsyncConnection, PooledConnection, PooledCursor, acheck_pooled, aconfigure_session, check_pooled,
    configure_session, dict_row, redact, tcp_bounds,
)
from ..errors import DatabaseUnavailable

#: Seconds a call waits for a pooled connection before it fails.
POOL_TIMEOUT = 30.0


def api_pool(dsn: str, *, pgbouncer: bool, prepared_statements: bool, idle_in_transaction: float,
             lease_ttl: float, max_size: int = 4) -> ConnectionPool:
    """An open pool of at most ``max_size`` connections to ``dsn`` for a
    :class:`~cyclone_mp.Client`'s calls (connections are made on demand; an idle one is
    closed after 60 s). ``idle_in_transaction`` and ``lease_ttl`` are seconds."""

    def configure(conn: psycopg.Connection[Any]) -> None:
        if not prepared_statements:
            conn.prepare_threshold = None
        configure_session(conn, idle_in_transaction=idle_in_transaction)

    return ConnectionPool(
        dsn, min_size=0, max_size=max_size, open=True, timeout=POOL_TIMEOUT, max_idle=60.0,
        kwargs={"autocommit": True, "row_factory": dict_row, "application_name": "cyclone_mp client",
                **tcp_bounds(max(5.0, lease_ttl)), **({"cursor_factory": PooledCursor} if pgbouncer else {})},
        connection_class=PooledConnection if pgbouncer else psycopg.Connection,
        name="cyclone-mp-client", check=check_pooled, configure=configure,
    )


async def async_api_pool(dsn: str, *, pgbouncer: bool, prepared_statements: bool, idle_in_transaction: float,
                         lease_ttl: float, max_size: int) -> AsyncConnectionPool:
    """:func:`api_pool` for an :class:`~cyclone_mp.AsyncClient`, opened without waiting
    for its first connection."""

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        if not prepared_statements:
            conn.prepare_threshold = None
        await aconfigure_session(conn, idle_in_transaction=idle_in_transaction)

    pool = AsyncConnectionPool(
        dsn, min_size=0, max_size=max_size, open=False, timeout=POOL_TIMEOUT, max_idle=60.0,
        kwargs={"autocommit": True, "row_factory": dict_row, "application_name": "cyclone_mp async client",
                **tcp_bounds(max(5.0, lease_ttl))}, name="cyclone-mp-async-client",
        connection_class=PooledAsyncConnection if pgbouncer else psycopg.AsyncConnection,
        check=acheck_pooled, configure=configure,
    )
    await pool.open(wait=False)
    return pool


async def aprobe(dsn: str, timeout: float) -> None:
    """Connect to ``dsn`` once and close (``timeout`` seconds, at least 2).

    Raises:
        DatabaseUnavailable: it could not connect (the message names the server, no password).
    """
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=max(2, int(timeout)))
        await conn.close()
    except psycopg.Error as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {redact(dsn)}: {redact(detail)}") from exc


async def aconnect(dsn: str, *, application_name: str, timeout: float = 10.0, dead_after: float = 30.0
                   ) -> psycopg.AsyncConnection[Any]:
    """An autocommit async connection with dict rows and TCP bounds (``dead_after``
    seconds). Raises the driver's error (:data:`~cyclone_mp.connections.DriverError`)."""
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True, row_factory=dict_row,
                                                 application_name=application_name,
                                                 connect_timeout=max(2, int(timeout)), **tcp_bounds(dead_after))
