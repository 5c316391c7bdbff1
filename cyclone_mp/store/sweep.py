"""The recovery sweep (SPEC 9; ``sql/sweep.sql``): the turn that one supervisor at a time
takes for it (and for the other maintenance tasks), the running rows whose lease expired
or whose DB deadline passed, what it writes for each (a timeout, a reclaim, a discard past
``max_reclaims``), and the workflow timers it fires."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, NamedTuple

from psycopg.types.json import Jsonb

from .. import decisions
from ..noderows import to_us
from .outcomes import advance, end_attempt, run_of
from .queries import Q
from .session import Session, translate


class Turn(NamedTuple):
    """What :meth:`Sweep.turn` found: whether the caller took the turn,
    the seconds until the turn it saw ends, and the seconds since the task last succeeded
    (None: never)."""

    mine: bool
    wait: float
    since_success: float | None


@dataclasses.dataclass(frozen=True)
class Expired:
    """What :meth:`Sweep.expire` did: ``action`` is ``"timeout"``, ``"reclaim"``,
    ``"reclaim_limit"`` or ``"none"``; ``ended`` the ``(step name, error kind)`` of the
    attempt it ended (timeout, reclaim_limit), else None; ``discarded`` the discarded
    step's ``{"run_id", "node", "step_name", "error_kind", "error"}``, else None."""

    action: str
    ended: tuple[str | None, str] | None = None
    discarded: dict[str, Any] | None = None


class Sweep:
    """The recovery sweep's statements on ``session``."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @translate
    def turn(self, owner: str, every: float, task: str = "sweep") -> Turn:
        """Take the recovery sweep's turn (or another maintenance ``task``'s: ``"history"``)
        for all supervisors when the last one is at least ``every`` seconds old (one
        statement, a row lock for its length).

        Returns a :class:`Turn`: ``mine`` is True when ``owner`` took it (it does the
        task now; the next turn is ``every`` seconds away), else ``wait`` is the seconds
        until the turn it saw ends (0 or more); ``since_success`` the seconds since a pass
        of the task last succeeded on any supervisor (:meth:`succeeded`), or
        None when none did."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["sweep_turn"], {"owner": owner, "every_us": to_us(every), "task": task})
            row = cur.fetchone()
        since = row["since_success"]
        if row["mine"]:
            return Turn(True, every, since)
        return Turn(False, max(0.0, float(row["due_in"] if row["due_in"] is not None else every)), since)

    @translate
    def succeeded(self, task: str = "sweep") -> None:
        """Record that a pass of the maintenance ``task`` ended without an error now (the
        database clock): every supervisor reads it with its turn (:meth:`turn`)."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["maintenance_succeeded"], {"task": task})

    @translate
    def candidates(self, limit: int = 100, *, owner: str | None = None,
                   held: Collection[tuple[int, int]] = ()) -> list[dict[str, Any]]:
        """Running rows whose lease expired or whose DB deadline passed (one page of at
        most ``limit``), but not the leases ``owner`` still holds: ``held`` are their
        ``(step id, lease generation)`` pairs. Such a lease stays ``owner``'s until its
        DB deadline passes (its keeper renews it, expired or not), so its own sweep never
        reclaims a step whose outcome it is about to write. Raises DatabaseError."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["sweep_candidates"], {"limit": limit, "owner": owner,
                                                "held_ids": [key[0] for key in held],
                                                "held_generations": [key[1] for key in held]})
            return cur.fetchall()

    @translate
    def expire(self, id: int, backoff_for: Callable[[str | None], Callable[[int], float]],
               entry: dict[str, Any]) -> Expired:
        """Settle one sweep candidate under the run lock then the step lock: ``backoff_for``
        gives a step name's backoff (seconds for an attempt number), ``entry`` is added to
        the error entry it writes.

        Returns an :class:`Expired`; its action is ``"none"`` when the row was renewed,
        finished or gone meanwhile. Raises DatabaseError.
        """
        discarded = None
        with self.session.tx() as cur:
            if self.session.one(cur, "lock_run_of_step", {"id": id}) is None:
                return Expired("none")
            row = self.session.one(cur, "sweep_recheck", {"id": id})
            if row is None:
                return Expired("none")
            action = decisions.expiry(
                timed_out=bool(row["timed_out"]), lease_expired=bool(row["lease_expired"]),
                reclaims=row["reclaims"], max_reclaims=row["max_reclaims"],
            ).action
            if action == "timeout":
                end = end_attempt(cur, id, row, decisions.TIMEOUT, {
                    **entry, "message": "timed out (database clock); settled by the recovery sweep",
                    "lease_owner": row["lease_owner"], "lease_generation": row["lease_generation"],
                }, backoff_for(row["step_name"]), swept=True)
                ended = end.error_kind
                if end.state == "discarded":
                    discarded = {"run_id": row["run_id"], "node": row["node"], "step_name": row["step_name"],
                                 "error_kind": ended, "error": "timed out (database clock)"}
            elif action == "reclaim":
                cur.execute(Q["reclaim"], {"id": id})
                cur.execute(Q["hold_paused"], {"run_id": run_of(cur, id)})
                cur.execute(Q["notify"], {"queue": row["queue"]})  # claimable at once, anywhere
            elif action == "reclaim_limit":
                n = row["reclaims"]
                message = f"lease expired after {n} reclaim{'' if n == 1 else 's'} (max_reclaims={row['max_reclaims']})"
                cur.execute(Q["discard_reclaim_limit"], {"id": id, "error": message, "entry": Jsonb({
                    **entry, "attempt": row["attempt"], "kind": decisions.RECLAIM_LIMIT, "message": message,
                    "lease_owner": row["lease_owner"], "lease_generation": row["lease_generation"],
                })})
                advance(cur, run_of(cur, id))
                ended = decisions.RECLAIM_LIMIT
                discarded = {"run_id": row["run_id"], "node": row["node"], "step_name": row["step_name"],
                             "error_kind": ended, "error": message}
        if action in ("timeout", "reclaim_limit"):
            return Expired(action, (row["step_name"], ended), discarded)
        return Expired(action)

    @translate
    def fire_due_timers(self, limit: int = 100) -> int:
        """Complete timer nodes due on the database clock; returns how many runs moved."""
        with self.session.conn.cursor() as cur:
            cur.execute(Q["due_timer_runs"], {"limit": limit})
            run_ids = [r["run_id"] for r in cur.fetchall()]
        for run_id in run_ids:
            with self.session.tx() as cur:
                if self.session.one(cur, "lock_run", {"run_id": run_id}) is not None:
                    advance(cur, run_id)
        return len(run_ids)
