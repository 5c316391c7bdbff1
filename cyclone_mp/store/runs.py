"""Runs as the client sees them: enqueue, the operator's actions and the reads (each an
operation planned in :mod:`cyclone_mp.operations`, shared with the async client)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

import psycopg

from ..filters import RunFilter
from . import operations
from .queries import NodeRow


class RunQueries:
    """Enqueue, cancel, retry, pause, resume, signal, reads and pruning (a part of
    :class:`~cyclone_mp.store.Store`)."""

    def enqueue_run(
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
        (:func:`cyclone_mp.store.operations.enqueue_run`).

        With ``conn`` the rows are written in the caller's open transaction (they exist
        only if it commits). With an ``idempotency_key`` already used, returns the
        existing run id and ``created=False``.
        """
        op = operations.enqueue_run(name=name, kind=kind, input=input, nodes=nodes, delay=delay,
                                    scheduled_at=scheduled_at, idempotency_key=idempotency_key)
        if conn is not None:
            return type(self)(conn).run(op, caller_tx=True)
        return self.run(op)

    def enqueue_many(self, **kwargs: Any) -> list[str]:
        """Insert many single-step runs in one statement (:func:`cyclone_mp.store.operations.enqueue_many`)."""
        return self.run(operations.enqueue_many(**kwargs))

    # -- operator actions (cyclone_mp.operations) -----------------------------------------

    def cancel_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.store.operations.cancel_run`."""
        return self.run(operations.cancel_run(run_id))

    def retry_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.store.operations.retry_run`."""
        return self.run(operations.retry_run(run_id))

    def pause_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.store.operations.pause_run`."""
        return self.run(operations.pause_run(run_id))

    def resume_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.store.operations.resume_run`."""
        return self.run(operations.resume_run(run_id))

    def signal(self, run_id: str, name: str, payload: Any) -> bool:
        """:func:`cyclone_mp.store.operations.signal`."""
        return self.run(operations.signal(run_id, name, payload))

    # -- reads ----------------------------------------------------------------------------

    def get_run(self, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The run row and its step rows. Raises RunNotFound."""
        return self.run(operations.get_run(run_id))

    def runs_by_prefix(self, prefix: str) -> list[str]:
        """Ids of at most two runs whose id starts with the hex ``prefix`` (index range scan)."""
        return self.run(operations.runs_by_prefix(prefix))

    def list_runs(self, *, filters: RunFilter = RunFilter(), limit: int = 50, archived: bool = False
                  ) -> list[dict[str, Any]]:
        """:func:`cyclone_mp.store.operations.list_runs`."""
        return self.run(operations.list_runs(filters=filters, limit=limit, archived=archived))

    def prune(self, *, older_than: float, batch: int = 1000) -> int:
        """:func:`cyclone_mp.store.operations.prune`."""
        return self.run(operations.prune(older_than=older_than, batch=batch))

    def delete_runs(self, run_ids: Sequence[str]) -> int:
        """:func:`cyclone_mp.store.operations.delete_runs`."""
        return self.run(operations.delete_runs(run_ids))


