"""Whole-server calls on connections of their own: databases made, dropped and listed
(tests, the demo), the server's client sessions (``cyclone-mp db stop``) and the
supervisors' VACUUM of the hot tables. Each raises :class:`~cyclone_mp.errors.DatabaseError`.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from ..connections import configure_session, connect, database_dsn
from .session import translate


#: pg_try_advisory_lock key of a VACUUM of the hot tables (one supervisor at a time)
VACUUM_LOCK = 0x637976616375756D  # "cyvacuum"


@translate
def vacuum_hot_tables(dsn: str, *, pgbouncer: bool = False, application_name: str | None = None,
                      lock_timeout: float = 10.0, statement_timeout: float = 300.0) -> float | None:
    """``VACUUM cyclone_steps, cyclone_runs`` on a connection of its own (VACUUM cannot run
    in a transaction, nor in a pipeline); returns the seconds it took, or None when another
    supervisor is vacuuming them (a session advisory lock). It waits at most
    ``lock_timeout`` seconds for its table locks (an autovacuum worker in its way is
    cancelled by the server after ``deadlock_timeout``) and runs at most
    ``statement_timeout``. Through PgBouncer in transaction mode (``pgbouncer``) it sends
    the VACUUM alone: no session setting, no session lock. A role that does not own the
    tables gets PostgreSQL's warning and nothing is vacuumed. Raises DatabaseError."""
    with connect(dsn, application_name=application_name, prepare=False) as conn:
        if not pgbouncer:
            if not conn.execute("SELECT pg_try_advisory_lock(%s) AS got", (VACUUM_LOCK,)).fetchone()["got"]:
                return None
            configure_session(conn, lock_timeout=lock_timeout, statement_timeout=statement_timeout)
        started = time.monotonic()
        conn.execute("VACUUM cyclone_steps, cyclone_runs")
        return time.monotonic() - started


@translate
def create_database(dsn: str, name: str) -> str:
    """``CREATE DATABASE name`` on the server of ``dsn`` (an admin connection); returns
    the new database's DSN. Raises DatabaseError (e.g. no CREATEDB privilege)."""
    with connect(dsn) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    return database_dsn(dsn, name)


@translate
def drop_database(dsn: str, name: str) -> bool:
    """``DROP DATABASE IF EXISTS name WITH (FORCE)`` (its sessions are ended) on the
    server of ``dsn``; True if it existed. Raises DatabaseError."""
    with connect(dsn) as conn:
        existed = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name)))
        return existed


@translate
def list_databases(dsn: str, prefix: str) -> list[str]:
    """Names of the server's databases that start with ``prefix``. Raises DatabaseError."""
    with connect(dsn) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s) ORDER BY 1",
                            (prefix,)).fetchall()
        return [row["datname"] for row in rows]


@translate
def client_sessions(dsn: str) -> list[dict[str, Any]]:
    """The server's client sessions other than this call's own: ``{"pid", "database",
    "application", "state"}`` each (from ``pg_stat_activity``). Raises DatabaseError."""
    with connect(dsn) as conn:
        return conn.execute(
            "SELECT pid, datname AS database, application_name AS application, state FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() ORDER BY pid").fetchall()
