"""Named SQL and the typed methods that run it (with :mod:`cyclone_mp.connections`, the
only modules that talk to psycopg).

Every query lives in a ``sql/*.sql`` file (one per concern) under a ``-- name:`` header
(STYLE pattern 1); migrations are the numbered files in ``sql/migrations`` applied under
an advisory lock. psycopg errors become :class:`~cyclone_mp.errors.DatabaseError` with the
cause kept (STYLE pattern 2). The store never decides a transition itself: it reads rows
under their locks and asks :mod:`cyclone_mp.decisions`.

A :class:`Store` is a :class:`Session` (``session.py``: the connection, transactions,
error translation, the client's operations) with one query object per concern:
``claims`` (``claims.py``), ``outcomes`` (``outcomes.py``: settle, complete, fail,
snooze, release), ``leases`` (``leases.py``: renewals), ``payloads`` (``payloads.py``),
``sweep`` (``sweep.py``), ``schedules``, ``registry`` and ``runs``. ``queries.py`` loads
the SQL and holds the rows' shapes.
"""

from __future__ import annotations

import psycopg

from ..connections import (  # the connections and their errors, re-exported for the store's callers
    PooledAsyncConnection, PooledConnection, PooledCursor, check_pooled, classify, configure_session, connect,
    database_dsn, redact, server_spoke, session_settings, stale_plan, tcp_bounds,
)
from ..noderows import NodeRow, limit_params, node_params, to_us
from .claims import ClaimResult, Claims
from .leases import Leases
from .outcomes import FailResult, Outcomes
from .payloads import Payloads
from .queries import (
    CANCEL_CHANNEL, FORENSIC_KEYS, INLINE_MAX, MIGRATION_LOCK, NOTIFY_CHANNEL, PARSE_CACHE_LENGTH, Q, FailedAttempt, Settled,
    nullable_jsonb,
)
from .registry import Registry
from .runs import Runs
from .schedules import Schedules
from .server import client_sessions, create_database, drop_database, list_databases, vacuum_hot_tables
from .session import AsyncStore, Session, adrive, drive, translate
from .sweep import Expired, Sweep, Turn


class Store(Session):
    """Typed access to the cyclone tables over one autocommit connection: a
    :class:`Session` and its query objects, one per concern (see the module's text).

    Methods that change several rows run in one transaction. All methods raise
    :class:`DatabaseError` when the database fails.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        super().__init__(conn)
        self.claims = Claims(self)
        self.outcomes = Outcomes(self, self.claims)
        self.leases = Leases(self)
        self.payloads = Payloads(self)
        self.sweep = Sweep(self)
        self.schedules = Schedules(self)
        self.registry = Registry(self)
        self.runs = Runs(self)


__all__ = [
    "CANCEL_CHANNEL", "FORENSIC_KEYS", "INLINE_MAX", "MIGRATION_LOCK", "NOTIFY_CHANNEL", "PARSE_CACHE_LENGTH", "Q", "AsyncStore",
    "ClaimResult", "Claims", "Expired", "FailResult", "FailedAttempt", "Leases", "NodeRow", "Outcomes", "Payloads",
    "Registry", "Runs", "Schedules", "Session", "Settled", "Store", "Sweep", "Turn", "adrive", "drive", "limit_params",
    "node_params", "nullable_jsonb", "to_us", "PooledAsyncConnection", "PooledConnection", "PooledCursor",
    "check_pooled",
    "classify", "client_sessions", "configure_session", "connect", "create_database", "database_dsn",
    "drop_database", "list_databases", "redact", "server_spoke", "session_settings", "stale_plan", "tcp_bounds",
    "translate", "vacuum_hot_tables",
]
