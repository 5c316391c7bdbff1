"""Leases held by a supervisor (SPEC 4): their renewal, addressed by id with the seed's
WHERE clause, why a renewal matched nothing, and the record that an attempt's processes
are dead (its step may run again at once). Statements: ``sql/attempts.sql``."""

from __future__ import annotations

from typing import Any, Collection, Sequence

from ..connections import statement_pipeline
from ..noderows import to_us
from .queries import Q, nullable_jsonb
from .session import Session, translate


class Leases:
    """Renewals and lease reads on ``session``."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @translate
    def renew_many(self, *, owner: str, items: Sequence[tuple[int, int, Any]], ttl: float) -> list[bool]:
        """Renew several leases for ``ttl`` seconds, ``(id, generation, progress or None[,
        start delay or None])`` items, in one round trip: still one renewal per step,
        addressed by id, with the seed's WHERE clause (the ``heartbeat`` statement: with it
        go the latest progress and the handler's start delay, seconds after the claim),
        each on a cursor of its own in one pipeline with one Sync. (psycopg's
        ``executemany(returning=True)`` waits for the results before it syncs: two round
        trips, so a renewal through a distant database took twice its round trip.) They
        share the pipeline's implicit transaction: a renewal that fails (a lock wait past
        ``lock_timeout``) fails them all, and the caller renews one by one. Returns, per
        item, whether it matched its row. Raises DatabaseError."""
        if not items:
            return []
        conn = self.session.conn
        cursors = []
        with statement_pipeline(conn):
            for item in items:
                cur = conn.cursor()
                cur.execute(Q["heartbeat"], {
                    "id": item[0], "owner": owner, "generation": item[1], "ttl_us": to_us(ttl),
                    "progress": nullable_jsonb(item[2]), "start_delay_us": to_us(item[3] if len(item) > 3 else None)})
                cursors.append(cur)
        matched = [cur.rowcount == 1 for cur in cursors]
        for cur in cursors:
            cur.close()
        return matched

    @translate
    def state(self, id: int) -> dict[str, Any] | None:
        """Step ``id``'s ``state``, ``lease_owner``, ``lease_generation``, whether its DB
        deadline passed (``timed_out``) and its last error's kind and generation; None
        when the step is gone."""
        with self.session.conn.cursor() as cur:
            return self.session.one(cur, "lease_state", {"id": id})

    @translate
    def mark_dead(self, keys: Sequence[tuple[int, int]], *, unstarted: Collection[tuple[int, int]] = ()) -> int:
        """Record that the processes of these ``(step id, lease generation)`` attempts,
        ended after a cancel or a timeout, are dead and reaped: their steps may run again
        (and their concurrency slots go to others) at once, without waiting for
        ``dead_by``. ``unstarted``: those of them whose handlers never started (held, or
        queued behind a busy child): the entry ``client.cancel`` wrote for such an
        attempt loses its ``started_at`` and ``elapsed`` and says it was cancelled before
        it started. Wakes the supervisors of the queues concerned; returns how many
        queues it woke."""
        if not keys:
            return 0
        with self.session.conn.cursor() as cur:
            cur.execute(Q["mark_dead"], {"ids": [k[0] for k in keys], "generations": [k[1] for k in keys],
                                         "started": [k not in unstarted for k in keys]})
            return int(cur.fetchone()["woken"])
