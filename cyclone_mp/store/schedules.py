"""Schedules and their definitions in the database (``sql/schedules.sql``); the logic,
what is due and what to enqueue, is :mod:`cyclone_mp.schedules`."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from psycopg.types.json import Jsonb

from ..noderows import to_us
from .queries import Q
from .session import Session, translate


class Schedules:
    """The schedule rows on ``session``."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @translate
    def sync(self, items: Sequence[tuple[str, str, str, dict[str, Any]]], active_s: float) -> None:
        """Create or refresh the rows of ``(name, fingerprint, target, spec)`` schedules and
        of their definitions (a new definition is in force from now on: see :meth:`tick`),
        then drop the definitions of those schedules that no supervisor declared within
        ``active_s`` seconds. Three statements, each its own transaction, each locking
        rows of one table in name order."""
        items = sorted(items)
        names = [i[0] for i in items]
        targets, specs = [i[2] for i in items], [Jsonb(i[3]) for i in items]
        with self.session.conn.cursor() as cur:
            cur.execute(Q["sync_schedules"], {"names": names, "targets": targets, "specs": specs})
            cur.execute(Q["sync_schedule_definitions"], {
                "names": names, "fingerprints": [i[1] for i in items], "targets": targets, "specs": specs,
                "active_us": to_us(active_s),
            })
            cur.execute(Q["forget_schedule_definitions"], {"names": names, "active_us": to_us(active_s)})

    @translate
    def tick(self, mine: Mapping[str, str], active_s: float,
                       decide: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
        """In one transaction: lock the due rows of the schedules ``mine`` names (name ->
        the caller's definition's fingerprint) whose definition in force is the caller's
        (SKIP LOCKED), read which definition is in force again now that they are held, and
        for each still the caller's call ``decide(row)`` (the row with ``since``: when
        that definition came into force; it may enqueue runs on this connection, inside
        the transaction) and write the row it returns. Returns how many rows were decided."""
        names = sorted(mine)
        with self.session.tx() as cur:
            cur.execute(Q["due_schedules"], {"names": names, "fingerprints": [mine[n] for n in names],
                                             "active_us": to_us(active_s)})
            rows = cur.fetchall()
            if not rows:
                return 0
            cur.execute(Q["schedules_in_force"], {"names": [r["name"] for r in rows], "active_us": to_us(active_s)})
            in_force = {r["name"]: r for r in cur.fetchall()}
            decided = 0
            for row in rows:
                now_in_force = in_force.get(row["name"])
                if now_in_force is None or now_in_force["fingerprint"] != mine[row["name"]]:
                    continue  # another definition was declared meanwhile: its supervisors decide
                new = decide({**row, "since": now_in_force["first_seen_at"]})
                cur.execute(Q["advance_schedule"], {**new, "spec": Jsonb(new["spec"])})
                decided += 1
            return decided

    @translate
    def list_all(self, active_s: float = 60.0) -> list[dict[str, Any]]:
        """Every schedule row with the database clock (``now``), ``age`` (seconds since a
        supervisor that defines it last ticked) and ``definitions``: those a supervisor
        declared within ``active_s`` seconds (``fingerprint``, ``target``, ``spec``,
        ``first_seen_at``, ``seen_at``, ``in_force``), the one in force first."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["list_schedules"])
            rows = cur.fetchall()
            cur.execute(Q["list_schedule_definitions"], {"active_us": to_us(active_s)})
            definitions: dict[str, list[dict[str, Any]]] = {}
            for d in cur.fetchall():
                listed = definitions.setdefault(d.pop("name"), [])
                listed.append({**d, "in_force": not listed})
        return [{**row, "definitions": definitions.get(row["name"], [])} for row in rows]

    @translate
    def delete(self, name: str, active_s: float) -> dict[str, Any] | None:
        """Delete the schedule row ``name`` unless a supervisor ticked it within ``active_s``
        seconds: ``{"age", "deleted"}``, or None when there is no such row."""
        with self.session.tx() as cur:
            cur.execute(Q["delete_schedule"], {"name": name, "active_s": active_s})
            return cur.fetchone()
