"""Runs as the supervisor and the tools see them on a store: enqueue (a schedule's, in
the caller's transaction), one run's rows, and deletion. Each is an
operation planned in :mod:`cyclone_mp.store.operations`, shared with the async client."""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

import psycopg

from ..noderows import NodeRow
from . import operations
from .session import Session


class Runs:
    """Run operations on ``session``."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def enqueue(
        self,
        *,
        name: str,
        kind: str,
        input: Any,
        nodes: Sequence[NodeRow],
        delay: float,
        scheduled_at: dt.datetime | None = None,
        idempotency_key: str | None,
        conn: psycopg.Connection | None = None,
    ) -> tuple[str, bool]:
        """Insert one run and its step rows, and NOTIFY; returns ``(run_id, created)``
        (:func:`cyclone_mp.store.operations.enqueue_run`; ``delay`` in seconds).

        With ``conn`` the rows are written in the caller's open transaction (they exist
        only if it commits). With an ``idempotency_key`` already used, returns the
        existing run id and ``created=False``. Raises DatabaseError.
        """
        op = operations.enqueue_run(name=name, kind=kind, input=input, nodes=nodes, delay=delay,
                                    scheduled_at=scheduled_at, idempotency_key=idempotency_key)
        if conn is not None:
            return Session(conn).run(op, caller_tx=True)
        return self.session.run(op)

    def get(self, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The run row and its step rows. Raises RunNotFound, DatabaseError."""
        return self.session.run(operations.get_run(run_id))

    def delete(self, run_ids: Sequence[str]) -> int:
        """Delete these runs (:func:`cyclone_mp.store.operations.delete_runs`); returns how
        many were deleted. Raises DatabaseError."""
        return self.session.run(operations.delete_runs(run_ids))
