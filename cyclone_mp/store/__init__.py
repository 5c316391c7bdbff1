"""Named SQL and the typed methods that run it (with :mod:`cyclone_mp.connections`, the
only modules that talk to psycopg).

Every query lives in ``sql/queries.sql`` under a ``-- name:`` header (STYLE pattern 1);
migrations are the numbered files in ``sql/migrations`` applied under an advisory lock.
psycopg errors become :class:`~cyclone_mp.errors.DatabaseError` with the cause kept
(STYLE pattern 2). The store never decides a transition itself: it reads rows under
their locks and asks :mod:`cyclone_mp.decisions`.

:class:`Store` is one class made of parts, one file each:

- ``queries.py``: the named SQL, the migrations' files, row and parameter shapes;
- ``base.py``: the connection, transactions, error translation, the client's
  operations (:func:`drive`) and :class:`AsyncStore`;
- ``leases.py``: the supervisor's hot path (claims, renewals, the completion and
  failure CAS, releases);
- ``runs.py``: enqueue, the operator's actions and the reads of runs;
- ``maintenance.py``: the recovery sweep, timers, schedules and the registry (with
  their reads);
- ``maps.py``: a join's reads of the outputs of a map node's items.
"""

from __future__ import annotations

from ..connections import (  # the connections and their errors, re-exported for the store's callers
    PooledAsyncConnection, PooledConnection, PooledCursor, check_pooled, classify, configure_session, connect,
    database_dsn, redact, server_spoke, session_settings, stale_plan, tcp_bounds,
)
from .base import AsyncStore, StoreBase, adrive, drive, translate
from .leases import LeaseQueries
from .maintenance import MaintenanceQueries
from .maps import MapQueries
from .queries import (
    CANCEL_CHANNEL, FORENSIC_KEYS, INLINE_MAX, MIGRATION_LOCK, NOTIFY_CHANNEL, PARSE_CACHE_LENGTH, Q, FailedAttempt, NodeRow, Settled,
    limit_params, node_params, nullable_jsonb, to_us,
)
from .runs import RunQueries
from .server import client_sessions, create_database, drop_database, list_databases, vacuum_hot_tables


class Store(LeaseQueries, RunQueries, MaintenanceQueries, MapQueries, StoreBase):
    """Typed access to the cyclone tables over one autocommit connection.

    Methods that change several rows run in one transaction. All methods raise
    :class:`DatabaseError` when the database fails.
    """


__all__ = [
    "CANCEL_CHANNEL", "FORENSIC_KEYS", "INLINE_MAX", "MIGRATION_LOCK", "NOTIFY_CHANNEL", "PARSE_CACHE_LENGTH", "Q", "AsyncStore",
    "FailedAttempt", "NodeRow", "Settled", "Store", "adrive", "drive", "limit_params", "node_params",
    "nullable_jsonb", "to_us", "PooledAsyncConnection", "PooledConnection", "PooledCursor", "check_pooled",
    "classify", "client_sessions", "configure_session", "connect", "create_database", "database_dsn",
    "drop_database", "list_databases", "redact", "server_spoke", "session_settings", "stale_plan", "tcp_bounds",
    "translate", "vacuum_hot_tables",
]
