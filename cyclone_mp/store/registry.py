"""The supervisors' registry (``sql/registry.sql``): each supervisor's row, refreshed with
its queues' paused flags, the live supervisors, and the depths of their queues."""

from __future__ import annotations

from typing import Any, Sequence

from psycopg.types.json import Jsonb

from ..noderows import to_us
from . import operations
from .queries import Q
from .session import Session, translate


class Registry:
    """The registry of supervisors on ``session``."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @translate
    def register(self, *, id: str, hostname: str, pid: int, info: dict[str, Any], live: float = 15.0,
                        queues: Sequence[str] = ()) -> tuple[int, list[str]]:
        """Announce or refresh this supervisor's registry row; returns how many supervisors
        are live (this one and those whose row was refreshed within ``live`` seconds) and
        which of ``queues`` are paused."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["register_worker"], {"id": id, "hostname": hostname, "pid": pid, "info": Jsonb(info),
                                               "live_us": to_us(live), "queues": list(queues)})
            row = cur.fetchone()
            return int(row["live"]), list(row["paused"] or [])

    @translate
    def queue_depths(self, queues: Sequence[str], cap: int = 100_000) -> list[dict[str, Any]]:
        """Per queue: ``queue``, ``depth`` (claimable steps, at most ``cap``) and ``oldest``
        (seconds the oldest of them has been claimable, or None)."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["queue_depths"], {"queues": list(queues), "cap": cap})
            return cur.fetchall()

    @translate
    def unregister(self, id: str) -> None:
        """Remove this supervisor's registry row."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["unregister_worker"], {"id": id})

    def workers(self, within: float = 15.0) -> list[dict[str, Any]]:
        """Supervisors that refreshed their row within ``within`` seconds."""
        return self.session.run(operations.list_workers(within))
